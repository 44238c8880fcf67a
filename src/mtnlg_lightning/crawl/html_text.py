"""A page's main text, in any language: trafilatura (mtnlg-extract's default), or jusText with the stop words of the
languages of the page's prose.

The language that picks jusText's stop-word list is named from the page's prose (its paragraphs of some length and
few links), never from the whole HTML: on an international site the template's English (cookie banner, menus,
footer) outweighs a short article, and CLD2 on the markup then calls a Spanish or Chinese page English, whose
stop words its paragraphs lack, so jusText judged every one boilerplate. jusText's length thresholds count
characters of alphabetic text; a Han character (Chinese, Japanese kanji) carries about three letters' worth (a
Chinese sentence runs to about a third of its English translation's characters) and a kana or Hangul syllable about
two, so those characters count that much toward a paragraph's length. The weights are rough: they move jusText's
thresholds to the right order of magnitude in those scripts, no more.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from mtnlg_lightning.crawl.language import UNKNOWN_LANGUAGE, identify_language, languages_of, stoplist_for

# jusText's defaults (its paper's settings, and NeMo-Curator's)
LENGTH_LOW, LENGTH_HIGH = 70, 200
STOPWORDS_LOW, STOPWORDS_HIGH = 0.30, 0.32
MAX_LINK_DENSITY = 0.2
MAX_HEADING_DISTANCE = 200

_HAN = re.compile("[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]")
_KANA_HANGUL = re.compile("[\u3040-\u30ff\uac00-\ud7af]")


def weighted_length(text: str) -> int:
    """Characters, a Han character counting 3 and a kana or Hangul syllable 2 (see the module's docstring)."""
    return len(text) + 2 * len(_HAN.findall(text)) + len(_KANA_HANGUL.findall(text))


@dataclass(frozen=True)
class PageText:
    text: str  # the main text; empty when the extractor kept nothing
    # ISO code of the main language of the page's prose (UNKNOWN_LANGUAGE when CLD2 cannot tell; None: not asked,
    # trafilatura having kept text)
    prose_language: str | None


def segment(html: str) -> list:
    """jusText's paragraphs of a page (its DOM cleaning and block splitting), not yet classified."""
    from justext.core import ParagraphMaker, html_to_dom, preprocessor  # optional extra [crawl]: imported on use

    return ParagraphMaker.make_paragraphs(preprocessor(html_to_dom(html)))


# A language holding more than this share of the page's prose lends jusText its stop words
MIN_LANGUAGE_PERCENT = 10


def prose_languages(paragraphs: list) -> list[tuple[str, str]]:
    """[(ISO code, CLD2 name)] of the languages of the page's prose, most first: the paragraphs of at least
    jusText's short length and at most its link density (all of the page's text when it has none)."""
    prose = [
        p.text for p in paragraphs if weighted_length(p.text) >= LENGTH_LOW and p.links_density() <= MAX_LINK_DENSITY
    ]
    text = "\n".join(prose) or "\n".join(p.text for p in paragraphs)
    return languages_of(text, MIN_LANGUAGE_PERCENT) if text.strip() else []


def justext_page(html: str) -> PageText:
    """jusText's classification with the stop words of every language of the page's prose (an English template
    around a Swedish article: English and Swedish stop words), lengths weighted by script. A paragraph in a language
    jusText has no list for is judged by length and link density only (jusText's language-independent mode)."""
    # optional extra [crawl]: imported on use
    from justext.core import classify_paragraphs, revise_paragraph_classification

    paragraphs = segment(html)
    languages = prose_languages(paragraphs)
    lists = {code: stoplist_for(code, name) for code, name in languages}
    stoplist = frozenset().union(*lists.values())
    unlisted = {code for code, words in lists.items() if not words}
    for p in paragraphs:
        own_list = stoplist
        if unlisted and identify_language(p.text)[0] in unlisted:
            own_list = frozenset()
        # an empty list: no stop-word density can be asked for
        low, high = (STOPWORDS_LOW, STOPWORDS_HIGH) if own_list else (0.0, 0.0)
        # the context-free step is per paragraph anyway, so each gets thresholds scaled to its own script
        scale = max(1, len(p.text)) / max(1, weighted_length(p.text))
        classify_paragraphs([p], own_list, LENGTH_LOW * scale, LENGTH_HIGH * scale, low, high, MAX_LINK_DENSITY)
    revise_paragraph_classification(paragraphs, MAX_HEADING_DISTANCE)
    text = "\n\n".join(p.text for p in paragraphs if not p.is_boilerplate)
    return PageText(text, languages[0][0] if languages else UNKNOWN_LANGUAGE)


def trafilatura_page(html: str) -> PageText:
    """trafilatura's main text; the prose language is named (from jusText's paragraphs) only when it keeps none,
    for the report."""
    import trafilatura  # optional extra [crawl]: imported on use

    text = trafilatura.extract(html, include_comments=False, include_tables=False) or ""
    if text.strip():
        return PageText(text, None)
    try:
        languages = prose_languages(segment(html))
    except Exception:  # markup lxml cannot parse: the page is still no_main_text, of no known language
        languages = []
    return PageText(text, languages[0][0] if languages else UNKNOWN_LANGUAGE)


def page_text(html: str, extractor: str) -> PageText:
    return trafilatura_page(html) if extractor == "trafilatura" else justext_page(html)
