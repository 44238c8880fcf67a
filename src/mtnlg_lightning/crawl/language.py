"""Language identification (pyCLD2, whose model ships inside the package) and jusText's stop-word list per language."""

from __future__ import annotations

import functools
import re

UNKNOWN_LANGUAGE = "un"
# C0 controls other than tab/newline/CR, and lone surrogates: CLD2 refuses them, JSON consumers choke on some
BAD_CHARS = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f\ud800-\udfff]")

# jusText names its stop-word lists after languages, as CLD2 names most languages; where the two names differ the
# list is found by the ISO code.
_JUSTEXT_LIST_OF_CODE = {
    "no": "Norwegian_Bokmal",
    "nn": "Norwegian_Nynorsk",
    "fy": "West_Frisian",
    "ht": "Haitian",
    "war": "Waray_Waray",
}


def _detect(text: str, html: bool) -> tuple[bool, list[tuple[str, int, str]]]:
    """(reliable, [(code, percent of the text, CLD2 name)] * 3, most first): CLD2's answer, codes cut to ISO 639-1
    (zh-Hant -> zh; CLD2 codes are ISO 639-1 where one exists) and ``un`` for its unknowns."""
    import pycld2  # optional extra [crawl]: imported on use

    try:
        reliable, _, details = pycld2.detect(BAD_CHARS.sub(" ", text), isPlainText=not html)
    except pycld2.error:
        return False, [(UNKNOWN_LANGUAGE, 0, "Unknown")]
    found = []
    for name, code, percent, _ in details:
        code = code.split("-")[0]
        found.append((UNKNOWN_LANGUAGE, 0, "Unknown") if code in ("un", "xx", "xxx") else (code, percent, name))
    return reliable, found


def identify_language(text: str, html: bool = False) -> tuple[str, float, str]:
    """(ISO 639-1 code, score in [0, 1], CLD2 language name) of the text's main language; ``un`` when CLD2
    cannot tell. The score is the share of the text CLD2 gives the language, zero when it calls it unreliable."""
    reliable, found = _detect(text, html)
    code, percent, name = found[0]
    return code, (percent / 100.0 if reliable else 0.0), name


def languages_of(text: str, min_percent: int = 0) -> list[tuple[str, str]]:
    """[(ISO 639-1 code, CLD2 name)] of the (up to three) languages CLD2 finds in the text, each holding more than
    ``min_percent`` of it, most first."""
    return [(code, name) for code, percent, name in _detect(text, False)[1] if percent > min_percent]


@functools.cache
def stoplist_for(code: str, cld2_name: str) -> frozenset[str]:
    """jusText's stop-word list for a language (ISO code and CLD2 name); empty when jusText has none (Chinese,
    Japanese, Thai, ...: jusText then judges paragraphs by length and link density only)."""
    import justext  # optional extra [crawl]: imported on use

    lists = {name.lower(): name for name in justext.get_stoplists()}
    name = _JUSTEXT_LIST_OF_CODE.get(code) or lists.get(cld2_name.replace(" ", "_").lower())
    return justext.get_stoplist(name) if name else frozenset()
