"""The raw corpus of the end-to-end pipeline: real English prose with planted duplicates and planted task text.

Real text that every Python install ships (the standard library's docstrings, as the demo uses) is cut into
web-page-sized documents; whole modules are held out to supply an evaluation set of LAMBADA-style cloze passages,
split at random into a *planted* half and a *control* half. Then, as a web crawl would have them:

* each planted passage is copied into `plant_copies` different training documents (at a paragraph boundary),
  verbatim or lightly edited (a word of the opening replaced, the opening's case changed): the leak that
  decontamination has to find;
* a fraction of the documents that hold no planted text get an exact copy, another fraction a near copy
  (~0.5% of words replaced, a boilerplate line added: Jaccard well above 0.8): what dedup has to find.

Everything is seeded; the ground truth (which document holds which passage, which record copies which) is written
beside the corpus so that the pipeline's report can check the tools against it.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from mtnlg_lightning.corpora.jsonl import atomic_write, dumps_line, write_json_atomic
from mtnlg_lightning.curation.ngrams import words_of
from mtnlg_lightning.curation.shingles import ShingleSpec, jaccard_strings, shingle_strings
from mtnlg_lightning.demo.synthetic.cloze import cloze_passages
from mtnlg_lightning.demo.synthetic.demo_corpus import demo_documents
from mtnlg_lightning.errors import MTNLGError

PARAGRAPH_BREAK = re.compile(r"\n\s*\n")
BOILERPLATE = (
    "Posted in Documentation | Leave a comment",
    "Share this page: Twitter Facebook Email",
    "Copyright notice: all rights reserved by the respective authors.",
    "Read more articles like this in our weekly newsletter.",
)
NGRAM = 13  # the decontamination n-gram: a control passage may share none with the training documents


@dataclass
class CorpusSpec:
    """What the raw corpus holds. The defaults are the full pipeline's; `smoke()` is the reduced run's
    (`mtnlg-pipeline --smoke`)."""

    eval_passages: int = 128  # cloze passages in the evaluation set: half planted, half control
    plant_copies: int = 6  # training documents each planted passage is copied into (< decontamination's
    # --frequent-threshold 10, above which a task n-gram counts as a common phrase and is ignored)
    edited_fraction: float = 0.5  # of the planted copies, the share lightly edited rather than verbatim
    exact_dup_fraction: float = 0.06  # of the documents without planted text: exact copies added
    near_dup_fraction: float = 0.06  # ... and near copies added
    held_out_fraction: float = 0.12  # of the text: whole modules held out as the source of the cloze passages
    page_chars: int = 3000  # long module docs are cut into pages of about this size at paragraph breaks
    max_pages: int | None = None  # keep only this many training pages (the reduced run)
    min_words: int = 24  # cloze passage length in words
    max_words: int = 80
    seed: int = 1234

    @classmethod
    def smoke(cls) -> CorpusSpec:
        return cls(eval_passages=16, plant_copies=4, max_pages=160, held_out_fraction=0.2)


def pages_of(module_id: str, text: str, page_chars: int) -> list[dict]:
    """Cut one module's docstrings into pages of about `page_chars` characters at paragraph breaks."""
    pages, current, size = [], [], 0
    for paragraph in PARAGRAPH_BREAK.split(text):
        if current and size + len(paragraph) > page_chars:
            pages.append(current)
            current, size = [], 0
        current.append(paragraph)
        size += len(paragraph) + 2
    if current:
        pages.append(current)
    return [{"id": f"{module_id}#{i}", "text": "\n\n".join(p)} for i, p in enumerate(pages)]


def ngram_set(text: str, n: int = NGRAM) -> set[tuple[str, ...]]:
    words = words_of(text)
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def lightly_edited(passage: str, rng: np.random.Generator, filler: list[str]) -> str:
    """Replace one word of the opening and capitalise the opening: words after the 6th stay as they are, so
    13-grams of the original survive (and so does the last word, the cloze target)."""
    words = passage.split()
    i = int(rng.integers(0, min(6, len(words) - 13)))
    words[i] = filler[int(rng.integers(0, len(filler)))]
    for j in range(min(3, len(words) - 1)):
        words[j] = words[j].upper()
    return " ".join(words)


def near_copy(text: str, rng: np.random.Generator, filler: list[str]) -> str:
    """About 0.5% of the words replaced and a boilerplate line added, as a mirror site re-publishes a page."""
    paragraphs = []
    for paragraph in PARAGRAPH_BREAK.split(text):
        words = paragraph.split(" ")
        hits = rng.random(len(words)) < 0.005
        paragraphs.append(
            " ".join(filler[int(rng.integers(0, len(filler)))] if h else w for w, h in zip(words, hits, strict=True))
        )
    line = BOILERPLATE[int(rng.integers(0, len(BOILERPLATE)))]
    return "\n\n".join([line, *paragraphs] if rng.random() < 0.5 else [*paragraphs, line])


def insert_at_paragraph(text: str, passage: str, rng: np.random.Generator) -> str:
    paragraphs = PARAGRAPH_BREAK.split(text)
    at = int(rng.integers(0, len(paragraphs) + 1))
    return "\n\n".join(paragraphs[:at] + [passage] + paragraphs[at:])


def pick_passages(modules, count, training_ngrams, taken, spec: CorpusSpec, rng) -> list[str]:
    """`count` cloze passages of `modules` sharing no 13-gram with the training text or with `taken` (updated)."""
    candidates = list(
        dict.fromkeys(cloze_passages([m["text"] for m in modules], 10**9, spec.min_words, spec.max_words))
    )
    chosen = []
    for i in rng.permutation(len(candidates)).tolist():
        grams = ngram_set(candidates[i])
        if not grams & training_ngrams and not grams & taken:
            chosen.append(candidates[i])
            taken |= grams
            if len(chosen) == count:
                return chosen
    raise MTNLGError(
        f"only {len(chosen)} clean cloze passages in half of the held-out modules, {count} asked for: "
        "raise held_out_fraction or lower eval_passages"
    )


def build_corpus(out_dir: str | Path, spec: CorpusSpec) -> dict:
    """Write `raw/web.jsonl`, `eval/{planted,control,evalset}.jsonl` and `raw/ground_truth.json` under `out_dir`;
    return the summary (counts and bytes) that the pipeline reports."""
    out = Path(out_dir)
    rng = np.random.default_rng(spec.seed)
    held_out, pages = _held_out_and_pages(spec, rng)

    # Cloze passages from the held-out modules whose 13-grams occur nowhere in the training pages (the standard
    # library repeats some docstrings across modules: such a passage would not be a clean control), nor in another
    # chosen passage (planted twice over, a shared 13-gram would count as a common phrase for decontamination's
    # --frequent-threshold and not be removed). Planted and control passages come from different modules, so that
    # what A learns from the planted copies about their modules' subject matter does not reach the control set.
    training_ngrams: set[tuple[str, ...]] = set()
    for page in pages:
        training_ngrams |= ngram_set(page["text"])
    taken: set[tuple[str, ...]] = set()
    halves = (spec.eval_passages // 2, spec.eval_passages - spec.eval_passages // 2)
    planted, control = (
        pick_passages(held_out[k::2], count, training_ngrams, taken, spec, rng) for k, count in enumerate(halves)
    )

    filler = sorted({w for p in pages for w in p["text"].split() if w.isalpha() and 4 <= len(w) <= 9})
    plants = _plant(pages, planted, spec, rng, filler)
    copies, duplicates = _duplicates(pages, plants, spec, rng, filler)

    records = pages + copies
    records = [records[i] for i in rng.permutation(len(records)).tolist()]
    write_jsonl(out / "raw" / "web.jsonl", records)
    write_jsonl(out / "eval" / "planted.jsonl", [{"text": p} for p in planted])
    write_jsonl(out / "eval" / "control.jsonl", [{"text": p} for p in control])
    write_jsonl(out / "eval" / "evalset.jsonl", [{"task": "cloze", "text": p} for p in planted + control])
    truth = {
        "spec": asdict(spec),
        "planted_passages": planted,
        "plants": plants,
        "duplicates": duplicates,
    }
    write_json_atomic(str(out / "raw" / "ground_truth.json"), truth)
    return {
        "documents": len(records),
        "bytes": sum(len(r["text"].encode("utf-8")) for r in records),
        "pages": len(pages),
        "held_out_modules": len(held_out),
        "planted_passages": len(planted),
        "control_passages": len(control),
        "planted_copies": sum(len(v) for v in plants.values()),
        "edited_copies": sum(h["edited"] for v in plants.values() for h in v),
        "exact_duplicates": sum(d["kind"] == "exact" for d in duplicates),
        "near_duplicates": sum(d["kind"] == "near" for d in duplicates),
        "near_duplicate_min_jaccard": min((d["jaccard"] for d in duplicates if d["kind"] == "near"), default=None),
    }


def _held_out_and_pages(spec: CorpusSpec, rng: np.random.Generator) -> tuple[list[dict], list[dict]]:
    """Whole modules held out (about `held_out_fraction` of the text, none over 5% of it), and the training pages
    the other modules are cut into (`max_pages` of them, when set)."""
    modules = demo_documents()
    order = rng.permutation(len(modules))
    total_chars = sum(len(m["text"]) for m in modules)
    held_out, training_modules, held_chars = [], [], 0
    for i in order.tolist():
        if held_chars < spec.held_out_fraction * total_chars and len(modules[i]["text"]) < 0.05 * total_chars:
            held_out.append(modules[i])
            held_chars += len(modules[i]["text"])
        else:
            training_modules.append(modules[i])
    pages = [p for m in training_modules for p in pages_of(m["id"], m["text"], spec.page_chars)]
    if spec.max_pages is not None:
        keep = sorted(rng.choice(len(pages), size=min(spec.max_pages, len(pages)), replace=False).tolist())
        pages = [pages[i] for i in keep]
    return held_out, pages


def _plant(pages: list[dict], planted: list[str], spec: CorpusSpec, rng, filler: list[str]) -> dict[str, list[dict]]:
    """Each planted passage into `plant_copies` pages (verbatim or lightly edited); page id -> what it holds."""
    plants: dict[str, list[dict]] = {}
    for index, passage in enumerate(planted):
        hosts = rng.choice(len(pages), size=spec.plant_copies, replace=False).tolist()
        for host in hosts:
            edited = bool(rng.random() < spec.edited_fraction)
            text = lightly_edited(passage, rng, filler) if edited else passage
            pages[host]["text"] = insert_at_paragraph(pages[host]["text"], text, rng)
            plants.setdefault(pages[host]["id"], []).append({"passage": index, "edited": edited})
    return plants


def _duplicates(pages: list[dict], plants: dict, spec: CorpusSpec, rng, filler: list[str]) -> tuple[list, list]:
    """Exact and near copies of pages that hold no planted text (near ones of pages of 2.5 KB or more): the copies,
    and what each one copies."""
    clean = [i for i, p in enumerate(pages) if p["id"] not in plants]
    n_exact = round(spec.exact_dup_fraction * len(clean))
    n_near = round(spec.near_dup_fraction * len(clean))
    sources = rng.permutation(clean).tolist()
    long_sources = [i for i in sources[n_exact:] if len(pages[i]["text"]) >= 2500][:n_near]
    copies, duplicates = [], []
    for i in sources[:n_exact]:
        copies.append({"id": pages[i]["id"] + "@mirror", "text": pages[i]["text"]})
        duplicates.append({"id": copies[-1]["id"], "of": pages[i]["id"], "kind": "exact", "jaccard": 1.0})
    word5 = ShingleSpec("word", 5)
    for i in long_sources:
        text = near_copy(pages[i]["text"], rng, filler)
        copies.append({"id": pages[i]["id"] + "@near", "text": text})
        jaccard = jaccard_strings(shingle_strings(pages[i]["text"], word5), shingle_strings(text, word5))
        duplicates.append({"id": copies[-1]["id"], "of": pages[i]["id"], "kind": "near", "jaccard": round(jaccard, 4)})
    return copies, duplicates


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(str(path)) as f:
        for record in records:
            f.write(dumps_line(record))
