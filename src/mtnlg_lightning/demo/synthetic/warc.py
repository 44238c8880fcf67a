"""A crawl made offline, with its truth written beside it: the test bed of `mtnlg-extract` and `mtnlg-quality`.

English pages carry real prose that every Python install ships (paragraphs of the standard library's docstrings,
as the demo corpus uses), wrapped in the boilerplate of a real site: a cookie banner, navigation, breadcrumbs, a
byline, share buttons, a sidebar of related links and a newsletter box, a footer. Pages in seven other languages
(or in all 14: Russian, Chinese, Japanese, Arabic, Turkish, Korean and Swedish too) carry short paragraphs written
for this purpose, in their own language's boilerplate or in the English site's (an international site, a CMS theme
left in English: the case that misleads a language identifier run on the whole page). Beside them: junk pages
(keyword spam, link farms, repeated lines, lorem ipsum, price lists), non-HTML payloads, redirects and missing
pages, and broken records (a garbled HTTP header, a body that claims gzip and is not, bytes that are not the
declared charset, an empty body, a corrupt gzip member). The truth file lists, per record, what it is and, for a
page, its language, its body paragraphs and its boilerplate text, so extraction can be scored word by word.
"""

from __future__ import annotations

import gzip
import io
import json
import re
import sysconfig
import zlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# --- real English prose: paragraphs of the standard library's docstrings -----------------------------------------

_DOCSTRING = re.compile(r'^[ \t]*[rRuU]?"""(.*?)"""', re.DOTALL | re.MULTILINE)


def _prose_paragraphs(docstring: str, min_words: int, min_chars: int) -> list[str]:
    out = []
    for para in re.split(r"\n\s*\n", docstring):
        lines = [line.strip() for line in para.strip().splitlines()]
        if not lines or any(line.startswith((">>>", "-", "*", "..", ":", "#", "|", "+")) for line in lines):
            continue
        if any(line.endswith("::") for line in lines):  # the paragraph introduces a code block
            continue
        words = " ".join(lines).split()
        if (
            len(words) < min_words
            or len(" ".join(words)) < min_chars
            or sum(w.strip(".,;:()'\"`").isalpha() for w in words) < 0.8 * len(words)
        ):
            continue
        out.append(" ".join(words))
    return out


def english_paragraphs(count: int, min_words: int = 35, min_chars: int = 200) -> list[tuple[str, str]]:
    """The first ``count`` prose paragraphs (module name, paragraph) of the standard library's docstrings, in
    file order; paragraphs repeated across modules are taken once. Article-length paragraphs by default: jusText
    keeps a page only when one of its paragraphs reaches 200 characters (its length_high)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    seen: set[str] = set()
    out: list[tuple[str, str]] = []
    for path in sorted(root.glob("*.py")):
        try:
            source = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        for m in _DOCSTRING.finditer(source):
            for para in _prose_paragraphs(m.group(1), min_words, min_chars):
                if para not in seen:
                    seen.add(para)
                    out.append((path.stem, para))
                    if len(out) >= count:
                        return out
    return out


# --- other languages: paragraphs written for this test bed ------------------------------------------------------

# Four short news, recipe, science and society paragraphs per language, data in warc_paragraphs.json. Their
# lengths are the language's own: ~250-300 characters in alphabetic scripts, ~80-130 in Chinese, Japanese and Korean.
FOREIGN_PARAGRAPHS: dict[str, list[str]] = json.loads(
    Path(__file__).with_name("warc_paragraphs.json").read_text("utf-8")
)
# The crawl's other languages by default (the pipeline's crawl and the tests written before the rest were added).
EUROPEAN_LANGUAGES = ("de", "fr", "es", "it", "nl", "pt", "pl")
# Every language with paragraphs: 14 besides English; Chinese and Japanese (no jusText stop-word list) among them.
ALL_LANGUAGES = tuple(FOREIGN_PARAGRAPHS)

# Each language's boilerplate: cookie banner (English also a long consent text, the one most sites show: long and
# full of stop words, so jusText takes it for prose), navigation, footer lines, sidebar heading and links, newsletter
# box, byline words, share buttons. Translations are data: warc_boilerplate.json beside this file.
_BOILERPLATE: dict[str, dict] = json.loads(Path(__file__).with_name("warc_boilerplate.json").read_text("utf-8"))


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def page_html(lang: str, title: str, body: list[str], rng: np.random.Generator) -> tuple[str, str]:
    """(HTML of a page, its boilerplate as plain text): the body paragraphs inside a typical site template in
    language ``lang`` (the template's language, which may differ from the body's)."""
    b = dict(_BOILERPLATE[lang])
    if "cookie_long" in b and rng.random() < 0.5:
        b["cookie"] = b["cookie_long"]
    date = f"2024-{rng.integers(1, 13):02d}-{rng.integers(1, 29):02d}"
    nav = "".join(f'<li><a href="/{i}">{_escape(x)}</a></li>' for i, x in enumerate(b["nav"]))
    links = [b["links"][i] for i in rng.permutation(len(b["links"]))]
    related = "".join(f'<li><a href="/post/{i}">{_escape(x)}</a></li>' for i, x in enumerate(links))
    footer = "".join(f'<li><a href="/f{i}">{_escape(x)}</a></li>' for i, x in enumerate(b["footer"][1:]))
    paragraphs = "\n".join(f"<p>{_escape(p)}</p>" for p in body)
    html = f"""<!DOCTYPE html>
<html lang="{lang}"><head><meta charset="utf-8"><title>{_escape(title)}</title>
<script>window.dataLayer = window.dataLayer || []; function gtag(){{dataLayer.push(arguments);}}</script>
<style>body {{ font-family: sans-serif; }} .cookie {{ position: fixed; bottom: 0; }}</style></head>
<body>
<div class="cookie-banner" id="consent"><span>{_escape(b["cookie"])}</span></div>
<header><nav><ul>{nav}</ul></nav></header>
<main><article>
<h1>{_escape(title)}</h1>
<div class="byline">{_escape(b["byline"])} {date}</div>
{paragraphs}
<div class="share">{_escape(b["share"])}</div>
</article>
<aside><h3>{_escape(b["related"])}</h3><ul>{related}</ul>
<div class="newsletter">{_escape(b["newsletter"])} <input type="email"><button>OK</button></div></aside>
</main>
<footer><p>{_escape(b["footer"][0])}</p><ul>{footer}</ul></footer>
</body></html>
"""
    boilerplate = " ".join(
        [b["cookie"], *b["nav"], b["byline"], date, b["share"], b["related"], *links, b["newsletter"], *b["footer"]]
    )
    return html, boilerplate


# --- junk: what a raw crawl is full of ---------------------------------------------------------------------------

_SPAM_WORDS = (
    "cheap best buy online discount free shipping price deal casino bonus win prize loan fast cash crypto "
    "replica watches pills hotel flights sale offer click now today limited exclusive top rated review"
).split()
_LOREM = (
    "lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod tempor incididunt ut labore et dolore "
    "magna aliqua ut enim ad minim veniam quis nostrud exercitation ullamco laboris nisi aliquip ex ea commodo"
).split()
_PRODUCTS = "USB cable charger case screen protector headphones adapter mouse keyboard lamp battery".split()
JUNK_KINDS = ("keyword_spam", "link_farm", "repeated_lines", "lorem_ipsum", "price_list", "seo_template")


def junk_text(kind: str, rng: np.random.Generator) -> str:
    """One junk document of the given kind (see JUNK_KINDS)."""
    if kind == "keyword_spam":
        return " ".join(rng.choice(_SPAM_WORDS, size=int(rng.integers(80, 200))))
    if kind == "link_farm":
        lines = [
            f"{' '.join(rng.choice(_SPAM_WORDS, 3))} >> www.{rng.choice(_SPAM_WORDS)}{rng.integers(99)}.biz"
            for _ in range(int(rng.integers(20, 50)))
        ]
        return "\n".join(lines)
    if kind == "repeated_lines":
        line = f"Click here to {rng.choice(['win', 'claim', 'get'])} your free {rng.choice(_PRODUCTS)} now!!!"
        return "\n".join([line] * int(rng.integers(15, 40)))
    if kind == "lorem_ipsum":
        return "Lorem ipsum dolor sit amet, " + " ".join(rng.choice(_LOREM, size=int(rng.integers(80, 200)))) + "."
    if kind == "price_list":
        return "\n".join(
            f"{rng.choice(_PRODUCTS)} {rng.choice(_PRODUCTS)} #{rng.integers(1000, 9999)} ... ${rng.integers(1, 99)}.99"
            for _ in range(int(rng.integers(20, 60)))
        )
    if kind == "seo_template":
        city = rng.choice(["Paris", "London", "Berlin", "Madrid", "Rome", "Tokyo", "Boston"])
        thing = rng.choice(["hotels", "flights", "plumbers", "lawyers", "dentists", "car rental"])
        sentences = [
            f"Looking for the best {thing} in {city}?",
            f"Find cheap {thing} in {city} today.",
            f"Compare {thing} {city} prices and book {thing} in {city} now.",
            f"Top rated {thing} {city} deals.",
            f"Best {thing} {city} {thing} {city} {thing} near me.",
        ]
        return " ".join(rng.choice(sentences, size=int(rng.integers(15, 40))))
    raise ValueError(f"unknown junk kind {kind!r}; choose one of {JUNK_KINDS}")


def junk_documents(count: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [junk_text(JUNK_KINDS[i % len(JUNK_KINDS)], rng) for i in range(count)]


def _title(paragraph: str) -> str:
    """A page title: the paragraph's first six words, or its first 12 characters in a script without spaces."""
    words = paragraph.split()
    return " ".join(words[:6]) if len(words) >= 6 else paragraph[:12]


# --- the WARC file -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CrawlSpec:
    english_pages: int = 40
    pages_per_language: int = 4
    paragraphs_per_page: tuple[int, int] = (3, 6)  # English pages: uniform in [lo, hi]
    junk_pages: int = 12
    seed: int = 0
    broken_records: bool = True  # False: a clean file (for readers that stop at the first corrupt record)
    languages: tuple[str, ...] = EUROPEAN_LANGUAGES  # the other languages, each pages_per_language pages
    foreign_paragraphs: tuple[int, int] = (2, 4)  # their paragraphs: uniform in [lo, hi], at most 4
    # the site template of those pages: "own" (their language's), "english", or "alternate" (own, English, ...)
    foreign_template: str = "own"


CRAWL_DATE = "2024-05-01T00:00:00Z"  # every record's WARC-Date: the same bytes on every run for a seed


def _record_id(url: str) -> str:
    return f"<urn:uuid:00000000-0000-4000-8000-{zlib.crc32(url.encode()):012d}>"


def _http_response(writer, url: str, body: bytes, headers: list[tuple[str, str]], status: str = "200 OK"):
    from warcio.statusandheaders import StatusAndHeaders  # optional extra [crawl]: imported on use

    http = StatusAndHeaders(status, headers + [("Content-Length", str(len(body)))], protocol="HTTP/1.1")
    warc_headers = {"WARC-Date": CRAWL_DATE, "WARC-Record-ID": _record_id(url)}
    record = writer.create_warc_record(
        url, "response", payload=io.BytesIO(body), http_headers=http, warc_headers_dict=warc_headers
    )
    writer.write_record(record)


def _raw_record(url: str, block: bytes) -> bytes:
    """A response record written by hand, for blocks warcio's writer refuses (a garbled HTTP header)."""
    head = (
        "WARC/1.0\r\nWARC-Type: response\r\n"
        f"WARC-Target-URI: {url}\r\nWARC-Date: {CRAWL_DATE}\r\nWARC-Record-ID: {_record_id(url)}\r\n"
        f"Content-Type: application/http; msgtype=response\r\nContent-Length: {len(block)}\r\n\r\n"
    ).encode()
    return head + block + b"\r\n\r\n"


def write_synthetic_warc(
    path: str | Path, spec: CrawlSpec = CrawlSpec(), english_pages: list[dict] | None = None
) -> list[dict]:
    """Write a gzip WARC (``path``) and its truth (``path`` + ``.truth.jsonl``); return the truth records.

    Truth ``kind``: ``page`` (a good page: ``language``, ``body`` paragraphs, ``boilerplate`` text), ``junk``,
    ``not_html``, ``not_2xx``, ``broken`` (with the ``reason`` the extractor should count).

    ``english_pages`` ({"id", "title", "body": [paragraphs]}, e.g. the documents of a planted corpus) replace the
    ``spec.english_pages`` pages cut from the standard library; their truth records keep the ``id``."""
    from warcio.warcwriter import WARCWriter  # optional extra [crawl]: imported on use

    rng = np.random.default_rng(spec.seed)
    events = _events(_pages(spec, rng, english_pages), spec)
    order = rng.permutation(len(events))
    buf = io.BytesIO()
    writer = WARCWriter(buf, gzip=True)
    info = writer.create_warcinfo_record(Path(path).name, {"software": "mtnlg synthetic crawl"})
    info.rec_headers.replace_header("WARC-Date", CRAWL_DATE)
    info.rec_headers.replace_header("WARC-Record-ID", _record_id(f"warcinfo:{spec.seed}"))
    writer.write_record(info)
    truth = []
    for n, i in enumerate(order):
        kind, what = events[i]
        url = f"https://site{n % 17}.example/{spec.seed}/{kind}/{n}"
        truth.append({"url": url, "kind": kind, **_write_event(writer, buf, url, kind, what, rng)})
    Path(path).write_bytes(buf.getvalue())
    with open(f"{path}.truth.jsonl", "w", encoding="utf-8") as f:
        for t in truth:
            f.write(json.dumps(t, ensure_ascii=False) + "\n")
    return truth


# a page: (language, title, body paragraphs, corpus id or None, language of its site template)
Page = tuple[str, str, list[str], str | None, str]


def _pages(spec: CrawlSpec, rng: np.random.Generator, english_pages: list[dict] | None) -> list[Page]:
    """The English pages (given, or cut from the standard library's paragraphs), then each other language's."""
    pages: list[Page] = []
    if english_pages is None:
        lo, hi = spec.paragraphs_per_page
        paragraphs = english_paragraphs(spec.english_pages * hi)
        cursor = 0
        for _ in range(spec.english_pages):
            n = int(rng.integers(lo, hi + 1))
            chunk = paragraphs[cursor : cursor + n]
            cursor += n
            if chunk:
                pages.append(("en", f"Notes on the {chunk[0][0]} module", [p for _, p in chunk], None, "en"))
    else:
        pages += [("en", p["title"], list(p["body"]), p["id"], "en") for p in english_pages]
    if spec.foreign_template not in ("own", "english", "alternate"):
        raise ValueError(f"foreign_template {spec.foreign_template!r}: choose own, english or alternate")
    for lang in spec.languages:
        paras = FOREIGN_PARAGRAPHS[lang]
        for k in range(spec.pages_per_language):
            lo, hi = spec.foreign_paragraphs
            order = rng.permutation(len(paras))[: int(rng.integers(lo, min(hi, len(paras)) + 1))]
            body = [paras[i] for i in order]
            english = spec.foreign_template == "english" or (spec.foreign_template == "alternate" and k % 2 == 1)
            pages.append((lang, _title(body[0]), body, None, "en" if english else lang))
    return pages


def _events(pages: list[Page], spec: CrawlSpec) -> list[tuple[str, object]]:
    """Every record of the crawl as (kind, what), before shuffling: the pages, junk, non-HTML, non-2xx, broken."""
    events: list[tuple[str, object]] = [("page", p) for p in pages]
    events += [("junk", JUNK_KINDS[i % len(JUNK_KINDS)]) for i in range(spec.junk_pages)]
    events += [("not_html", kind) for kind in ("image/jpeg", "application/pdf", "application/json", "text/css")]
    events += [("not_2xx", status) for status in ("301 Moved Permanently", "404 Not Found")]
    if spec.broken_records:
        events += [
            ("broken", reason)
            for reason in ("bad_http_headers", "content_decoding", "undecodable", "empty_payload", "unreadable_record")
        ]
    return events


def _write_event(writer, buf: io.BytesIO, url: str, kind: str, what, rng: np.random.Generator) -> dict:
    """One record at `url`; returns its truth beyond the url and kind."""
    if kind == "page":
        lang, title, body, page_id, template = what
        html, boilerplate = page_html(template, title, body, rng)
        _http_response(writer, url, html.encode("utf-8"), [("Content-Type", "text/html; charset=utf-8")])
        return (
            {"language": lang, "title": title, "body": body, "boilerplate": boilerplate}
            | ({"id": page_id} if page_id is not None else {})
            | ({"template": template} if template != lang else {})
        )
    if kind == "junk":
        text = junk_text(what, rng)
        html = "<html><body>" + "".join(f"<div>{_escape(line)}</div>" for line in text.split("\n")) + "</body></html>"
        _http_response(writer, url, html.encode("utf-8"), [("Content-Type", "text/html")])
        return {"junk": what, "text": text}
    if kind == "not_html":
        payload = {
            "image/jpeg": b"\xff\xd8\xff\xe0" + bytes(rng.integers(0, 256, 300, dtype=np.uint8)),
            "application/pdf": b"%PDF-1.4\n1 0 obj << /Type /Catalog >> endobj\n%%EOF",
            "application/json": b'{"items": [1, 2, 3]}',
            "text/css": b"body { margin: 0 }",
        }[what]
        _http_response(writer, url, payload, [("Content-Type", what)])
        return {"reason": "not_html"}
    if kind == "not_2xx":
        _http_response(writer, url, b"<html><body>moved</body></html>", [("Content-Type", "text/html")], what)
        return {"reason": "http_status_not_2xx"}
    _write_broken(writer, buf, url, what)
    return {"reason": what}


def _write_broken(writer, buf: io.BytesIO, url: str, reason: str) -> None:
    html = b"<html><body><p>This page is broken in transit and must be counted, not extracted.</p></body></html>"
    if reason == "bad_http_headers":
        garbled = _raw_record(url, b"GARBLED STATUS LINE\r\nno headers here\r\n\r\n" + html)
        buf.write(gzip.compress(garbled, mtime=0))
    elif reason == "content_decoding":  # says gzip, is not
        _http_response(
            writer,
            url,
            b"\x1f\x8b\x08\x00not really gzip" + html,
            [("Content-Type", "text/html"), ("Content-Encoding", "gzip")],
        )
    elif reason == "undecodable":  # declared UTF-8, holds Latin-1 bytes
        _http_response(
            writer,
            url,
            "<html><body><p>Caf\u00e9 cr\u00e8me br\u00fbl\u00e9e</p></body></html>".encode("latin-1"),
            [("Content-Type", "text/html; charset=utf-8")],
        )
    elif reason == "empty_payload":
        _http_response(writer, url, b"", [("Content-Type", "text/html")])
    elif reason == "unreadable_record":  # a gzip member whose bytes are corrupt
        member = bytearray(gzip.compress(_raw_record(url, b"HTTP/1.1 200 OK\r\n\r\n" + html), mtime=0))
        member[12:40] = b"\x00" * 28
        buf.write(bytes(member))
    else:
        raise ValueError(f"unknown broken record {reason!r}")


# --- scoring an extraction against the truth ---------------------------------------------------------------------

# Words; in Chinese and Japanese, which put no spaces between words, each Han or kana character counts as one.
_CJK = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"
_WORD = re.compile(f"[{_CJK}]|[^\\W{_CJK}]+", re.UNICODE)


def _words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def score_extraction(truth: list[dict], documents: list[dict]) -> dict:
    """Compare extracted documents (by url) with the planted pages: pages found, body words kept (of the pages found;
    ``article_words_kept``: of every page, a page not found losing all of its words), boilerplate words left (words
    of the page's boilerplate that are neither body nor title words: a page's heading is kept by design and is
    neither), language accuracy."""
    by_url = {d["url"]: d for d in documents}
    pages = [t for t in truth if t["kind"] == "page"]
    found = body_total = body_kept = boiler_total = boiler_left = right_language = missing_words = 0
    missing, wrong_language = [], []
    for t in pages:
        doc = by_url.get(t["url"])
        if doc is None:
            missing.append(t["url"])
            missing_words += len(_words(" ".join(t["body"])))
            continue
        found += 1
        got = Counter(_words(doc["text"])) - Counter(_words(t.get("title", "")))
        body = Counter(_words(" ".join(t["body"])))
        boiler = Counter(_words(t["boilerplate"]))
        body_total += sum(body.values())
        body_kept += sum((got & body).values())
        boiler_total += sum(boiler.values())
        boiler_left += sum(((got - body) & boiler).values())
        if doc["language"] == t["language"]:
            right_language += 1
        else:
            wrong_language.append((t["url"], t["language"], doc["language"]))
    return {
        "pages": len(pages),
        "pages_found": found,
        "missing": missing,
        "body_words_kept": body_kept / max(1, body_total),
        "article_words_kept": body_kept / max(1, body_total + missing_words),
        "boilerplate_words_left": boiler_left / max(1, boiler_total),
        "language_accuracy": right_language / max(1, found),
        "wrong_language": wrong_language,
    }
