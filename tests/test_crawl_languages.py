"""`mtnlg-extract` keeps the text of pages in any language: on a crawl of English articles and pages in 14 other
languages (half of them in an English site's template, one to four paragraphs each), trafilatura (the default) and
jusText both keep >= 95% of the non-English pages with the right language, >= 95% of the article words and <= 5%
of the boilerplate words; a page the extractor keeps nothing of is counted under its own outcome, by language."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest

for module in ("warcio", "trafilatura", "justext", "pycld2", "lxml_html_clean"):
    pytest.importorskip(module)

from mtnlg_lightning.crawl import extract_cli  # noqa: E402
from mtnlg_lightning.crawl.extract import NO_MAIN_TEXT, drop_policy_lines  # noqa: E402
from mtnlg_lightning.crawl.html_text import justext_page  # noqa: E402
from mtnlg_lightning.crawl.language import identify_language, stoplist_for  # noqa: E402
from mtnlg_lightning.demo.synthetic.warc import (  # noqa: E402
    ALL_LANGUAGES,
    FOREIGN_PARAGRAPHS,
    CrawlSpec,
    page_html,
    score_extraction,
    write_synthetic_warc,
)

MULTILINGUAL = CrawlSpec(
    english_pages=20,
    pages_per_language=4,
    junk_pages=6,
    seed=21,
    languages=ALL_LANGUAGES,
    foreign_template="alternate",
    foreign_paragraphs=(1, 4),
)


def read_jsonl(path):
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


@pytest.fixture(scope="module")
def multilingual(tmp_path_factory):
    root = tmp_path_factory.mktemp("multilingual")
    warc = root / "multilingual.warc.gz"
    return warc, write_synthetic_warc(warc, MULTILINGUAL)


@pytest.mark.parametrize("extractor", ["default", "justext"])
def test_pages_in_fourteen_other_languages_keep_their_text_and_their_language(multilingual, tmp_path, extractor):
    warc, truth = multilingual
    flags = [] if extractor == "default" else ["--extractor", extractor]
    assert extract_cli.main([str(warc), "-o", str(tmp_path), "-q", *flags]) == 0
    docs = read_jsonl(tmp_path / "multilingual.jsonl")

    foreign = [t for t in truth if t["kind"] == "page" and t["language"] != "en"]
    assert len({t["language"] for t in foreign}) == 14 and len(foreign) == 56
    assert sum(t.get("template") == "en" for t in foreign) == 28  # every other page in the English site's template
    score = score_extraction(foreign, docs)
    kept_with_right_language = score["pages_found"] - len(score["wrong_language"])
    assert kept_with_right_language >= 0.95 * len(foreign), (score["missing"], score["wrong_language"])

    every_page = score_extraction(truth, docs)
    assert every_page["pages"] == 20 + 56
    assert every_page["article_words_kept"] >= 0.95  # of every page, the pages not found counting as lost
    assert every_page["boilerplate_words_left"] <= 0.05
    assert every_page["language_accuracy"] >= 0.95, every_page["wrong_language"]


@pytest.mark.parametrize("language", ["es", "zh"])
def test_the_stop_words_follow_the_articles_language_not_the_english_template_around_it(language):
    """One paragraph in an English site's template with its long consent banner: CLD2 on the whole HTML calls the
    page English (the trap: English stop words, which the article lacks); its prose is named right and kept."""
    body = FOREIGN_PARAGRAPHS[language][:1]
    html, boilerplate = page_html("en", "Title", body, np.random.default_rng(2))
    assert "partners use cookies" in boilerplate  # the long banner
    assert identify_language(html, html=True)[0] == "en"

    text, _ = drop_policy_lines(justext_page(html).text)
    assert body[0] in text
    assert identify_language(text)[0] == language


def test_jusText_stop_word_lists_are_found_by_language_and_missing_ones_are_empty():
    assert "el" in stoplist_for("es", "SPANISH") and "och" in stoplist_for("sv", "SWEDISH")
    assert "og" in stoplist_for("no", "NORWEGIAN")  # jusText calls it Norwegian_Bokmal
    assert stoplist_for("zh", "Chinese") == frozenset() == stoplist_for("ja", "Japanese")


def _warc_of(pages: list[tuple[str, str]]) -> bytes:
    from warcio.statusandheaders import StatusAndHeaders
    from warcio.warcwriter import WARCWriter

    buf = io.BytesIO()
    writer = WARCWriter(buf, gzip=True)
    for i, (template, paragraph) in enumerate(pages):
        html, _ = page_html(template, "Title", [paragraph], np.random.default_rng(i))
        body = html.encode("utf-8")
        http = StatusAndHeaders("200 OK", [("Content-Type", "text/html; charset=utf-8")], protocol="HTTP/1.1")
        record = writer.create_warc_record(
            f"https://short.example/{i}", "response", payload=io.BytesIO(body), http_headers=http
        )
        writer.write_record(record)
    return buf.getvalue()


def test_a_page_jusText_keeps_nothing_of_is_counted_by_its_language_and_reported(tmp_path, capsys):
    """jusText keeps a page only when a paragraph reaches 200 characters (a Korean syllable counting two): these
    pages' one paragraph is shorter, so jusText keeps nothing, and the run says so, by language; trafilatura (the
    default) keeps them."""
    short_korean = "시는 다음 달부터 도심을 운행하는 버스의 배차 간격을 줄이겠다고 발표했습니다."
    short_spanish = "El ayuntamiento ha decidido ampliar el horario de la piscina municipal este verano."
    warc = tmp_path / "short.warc.gz"
    warc.write_bytes(_warc_of([("ko", short_korean), ("es", short_spanish)]))

    assert extract_cli.main([str(warc), "-o", str(tmp_path / "j"), "--extractor", "justext"]) == 0
    report = json.loads((tmp_path / "j" / "extract_report.json").read_text())
    assert report["outcomes"] == {NO_MAIN_TEXT: 2} and report["no_main_text_languages"] == {"es": 1, "ko": 1}
    summary = capsys.readouterr().out
    assert "2 pages whose every paragraph justext judged boilerplate" in summary and "es 1, ko 1" in summary

    assert extract_cli.main([str(warc), "-o", str(tmp_path / "t"), "-q"]) == 0
    kept = read_jsonl(tmp_path / "t" / "short.jsonl")
    assert [d["language"] for d in kept] == ["ko", "es"]
    assert short_korean in kept[0]["text"] and short_spanish in kept[1]["text"]
