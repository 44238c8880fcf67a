"""Labelled synthetic corpora for measuring the curation tools.

* :func:`make_near_dup_corpus`: English-like documents (Zipf-distributed vocabulary: ~300 real function and
  content words followed by a long tail of pronounceable pseudo-words; sentences and paragraphs) arranged in
  *families*: a base document plus variants made with known edits (word substitutions / insertions /
  deletions at a rate, added boilerplate, excerpts, paragraph shuffles, exact and case/whitespace copies).
  Every record carries ``family`` and ``edit`` labels; the ground truth is the exact Jaccard of the string
  shingle sets (:func:`ground_truth_pairs`), computed on the same shingling as the dedup tool.
* :func:`make_tasks_and_training`: task files and training documents for decontamination benchmarks.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Iterable

import numpy as np

from mtnlg_lightning.curation.dedup import WORK_DIR_NAME, DedupConfig, run_dedup
from mtnlg_lightning.curation.lsh import decode_pairs
from mtnlg_lightning.curation.shingles import (
    ShingleSpec,
    jaccard_strings,
    normalize_chars,
    normalize_words,
    shingle_strings,
)

COMMON_WORDS = """the of and to a in is that for it as was with be by on not he this are or his from at which
but have an they you were her she there been one all we their has would when if so no what up out more said
its into who them some could him time than only new other then also any these two may first do like our
over such me after most made between can even should well about where many before through much people
through back years work way just because state world life day still those while part know great however
under three little place same public against during since own long general being right end without last
old found number use city water high system small another house country point large group both few often
school name government study early given city family power interest change around development thought home
report social local area book order law half across history set need every less today whole market economic
light open money business following night example land city least among power national language young river
story question figure began street field head problem health community whether within present seen real
member though best south north west east period course case body possible form result view free second
human early policy service data support important process level rather music model several million control
record sense common research team thus center experience church office century level human design produced
late nature early major matter voice character mind growth range board ground energy position according
evidence building wall theory image series lower particular material space class market table test""".split()

_SYLLABLES = (
    "ba be bi bo bu ca ce ci co cu da de di do du fa fe fi fo ga ge gi go ha he hi ho ka ke ki ko la le li lo "
    "lu ma me mi mo mu na ne ni no nu pa pe pi po pu ra re ri ro ru sa se si so su ta te ti to tu va ve vi vo "
    "wa we wi za ze zo ar er ir or ur an en in on un al el il ol ist ent ion ant ous ive ing ed ly"
).split()

BOILERPLATE = [
    "Subscribe to our newsletter for the latest updates and exclusive offers delivered straight to your inbox "
    "every week.",
    "All rights reserved. No part of this publication may be reproduced without prior written permission of the "
    "publisher.",
    "Click here to read more stories like this one and follow us on social media for daily news and analysis.",
    "This article was originally published on our partner site and is republished here with permission of the author.",
    "Cookies help us deliver our services. By using our services you agree to our use of cookies and privacy policy.",
]


def build_vocabulary(size: int = 30000, seed: int = 1234) -> list[str]:
    """Real common words first (high ranks), then unique pseudo-words built from syllables."""
    rng = np.random.default_rng(seed)
    vocab = list(dict.fromkeys(COMMON_WORDS))
    seen = set(vocab)
    while len(vocab) < size:
        k = int(rng.integers(2, 5))
        w = "".join(_SYLLABLES[i] for i in rng.integers(0, len(_SYLLABLES), k))
        if w not in seen:
            seen.add(w)
            vocab.append(w)
    return vocab


class TextGenerator:
    """Zipf–Mandelbrot word sampler producing sentences and paragraphs."""

    def __init__(self, seed: int = 0, vocab_size: int = 30000, zipf_s: float = 1.05, zipf_q: float = 2.7):
        self.rng = np.random.default_rng(seed)
        self.vocab = build_vocabulary(vocab_size)
        w = 1.0 / (np.arange(len(self.vocab)) + zipf_q) ** zipf_s
        self.cdf = np.cumsum(w / w.sum())

    def words(self, n: int) -> list[str]:
        idx = np.searchsorted(self.cdf, self.rng.random(n))
        idx[idx >= len(self.vocab)] = len(self.vocab) - 1
        v = self.vocab
        return [v[i] for i in idx.tolist()]

    def sentence_tokens(self) -> list[str]:
        toks = self.words(int(self.rng.integers(6, 25)))
        toks[0] = toks[0].capitalize()
        if len(toks) > 8 and self.rng.random() < 0.4:
            c = int(self.rng.integers(3, len(toks) - 3))
            toks[c] += ","
        toks[-1] += "."
        return toks

    def paragraph(self, n_sent: int | None = None) -> list[str]:
        n_sent = n_sent or int(self.rng.integers(3, 8))
        toks: list[str] = []
        for _ in range(n_sent):
            toks += self.sentence_tokens()
        return toks

    def document(self, chars: int = 3600) -> list[list[str]]:
        paras: list[list[str]] = []
        size = 0
        while size < chars:
            p = self.paragraph()
            paras.append(p)
            size += sum(len(t) + 1 for t in p) + 1
        return paras


def render(paras: list[list[str]]) -> str:
    return "\n\n".join(" ".join(p) for p in paras)


# ----------------------------------------------------------------------------------------------------------
# Near-duplicate variants


def _edit_words(gen: TextGenerator, paras, rate: float, ops=("sub", "ins", "del")) -> list[list[str]]:
    rng = gen.rng
    out = []
    for p in paras:
        q: list[str] = []
        draws = rng.random(len(p))
        choice = rng.integers(0, len(ops), len(p))
        for t, r, c in zip(p, draws.tolist(), choice.tolist(), strict=True):
            if r >= rate:
                q.append(t)
                continue
            op = ops[c]
            if op == "sub":
                q.append(gen.words(1)[0])
            elif op == "ins":
                q.append(t)
                q.append(gen.words(1)[0])
            # "del": drop the token
        out.append(q or p[:1])
    return out


def make_variant(gen: TextGenerator, base: list[list[str]]) -> tuple[list[list[str]], str]:
    """One variant of ``base`` with a randomly chosen edit; returns (paragraphs, edit label)."""
    rng = gen.rng
    kind = rng.choice(
        ["exact", "case_ws", "sub", "ins", "del", "mixed", "boilerplate", "excerpt", "shuffle", "mixed_boiler"],
        p=[0.08, 0.05, 0.22, 0.08, 0.08, 0.17, 0.08, 0.08, 0.06, 0.10],
    )
    if kind == "exact":
        return [list(p) for p in base], "exact"
    if kind == "case_ws":
        return [[t.upper() if i % 7 == 0 else t for i, t in enumerate(p)] for p in base], "case_ws"
    if kind in ("sub", "ins", "del"):
        rate = float(rng.uniform(0.002, 0.06))
        return _edit_words(gen, base, rate, (kind,)), f"{kind}:{rate:.3f}"
    if kind == "mixed":
        rate = float(rng.uniform(0.002, 0.05))
        return _edit_words(gen, base, rate), f"mixed:{rate:.3f}"
    if kind in ("boilerplate", "mixed_boiler"):
        paras = [list(p) for p in base]
        if kind == "mixed_boiler":
            rate = float(rng.uniform(0.002, 0.03))
            paras = _edit_words(gen, paras, rate)
        bp = BOILERPLATE[int(rng.integers(0, len(BOILERPLATE)))].split()
        if rng.random() < 0.5:
            paras.insert(0, bp)
        else:
            paras.append(bp)
        return paras, kind
    if kind == "excerpt":
        frac = float(rng.uniform(0.75, 0.97))
        flat = [(i, t) for i, p in enumerate(base) for t in p]
        keep = max(1, int(len(flat) * frac))
        start = int(rng.integers(0, len(flat) - keep + 1))
        paras_d: dict[int, list[str]] = {}
        for i, t in flat[start : start + keep]:
            paras_d.setdefault(i, []).append(t)
        return list(paras_d.values()), f"excerpt:{frac:.2f}"
    # paragraph shuffle
    paras = [list(p) for p in base]
    order = rng.permutation(len(paras))
    return [paras[i] for i in order], "shuffle"


def make_near_dup_corpus(
    n_docs: int,
    seed: int = 0,
    doc_chars: int = 3600,
    dup_fraction: float = 0.3,
    mean_variants: float = 2.5,
) -> list[dict]:
    """Records ``{"id", "text", "family", "edit"}``, shuffled. About ``dup_fraction`` of the documents are
    variants of another document (same ``family``); the rest are unique bases."""
    gen = TextGenerator(seed)
    rng = gen.rng
    docs: list[dict] = []
    fam = 0
    n_var_total = int(n_docs * dup_fraction)
    n_var = 0
    while len(docs) < n_docs:
        base = gen.document(int(doc_chars * rng.uniform(0.6, 1.4)))
        members = [(base, "base")]
        if n_var < n_var_total:
            k = min(1 + int(rng.geometric(1.0 / mean_variants)) - 1, n_var_total - n_var, n_docs - len(docs) - 1)
            k = max(k, 0)
            for _ in range(k):
                src = members[int(rng.integers(0, len(members)))][0] if rng.random() < 0.3 else base
                members.append(make_variant(gen, src))
            n_var += k
        for paras, label in members:
            docs.append({"text": render(paras), "family": fam, "edit": label})
        fam += 1
    docs = docs[:n_docs]
    order = rng.permutation(len(docs))
    out = []
    for new_i, i in enumerate(order.tolist()):
        d = docs[i]
        out.append({"id": f"doc{new_i:07d}", **d})
    return out


_DEFAULT_SPEC = ShingleSpec()


def ground_truth_pairs(records: list[dict], spec: ShingleSpec = _DEFAULT_SPEC) -> list[tuple[int, int, float]]:
    """Exact Jaccard (string shingle sets) of every within-family pair: ``[(i, j, J), ...]`` with i < j.

    Pairs across families are unrelated random texts (J ~ 0); :func:`true_jaccard` checks any of them."""
    fams: dict[int, list[int]] = {}
    for i, r in enumerate(records):
        fams.setdefault(r["family"], []).append(i)
    cache: dict[int, set[str]] = {}
    out = []
    for members in fams.values():
        if len(members) < 2:
            continue
        for i in members:
            cache[i] = shingle_strings(records[i]["text"], spec)
        for i, j in itertools.combinations(sorted(members), 2):
            out.append((i, j, jaccard_strings(cache[i], cache[j])))
    return out


def true_jaccard(records: list[dict], i: int, j: int, spec: ShingleSpec = _DEFAULT_SPEC) -> float:
    return jaccard_strings(shingle_strings(records[i]["text"], spec), shingle_strings(records[j]["text"], spec))


def accuracy(
    records: list[dict],
    truth: list[tuple[int, int, float]],
    candidate_pairs: Iterable[tuple[int, int]],
    verified_pairs: Iterable[tuple[int, int]],
    cluster_of: list[int] | np.ndarray,
    threshold: float = 0.8,
    spec: ShingleSpec = _DEFAULT_SPEC,
    rep: list[int] | np.ndarray | None = None,
) -> dict:
    """Recall by Jaccard bucket (direct = the pair became an LSH candidate and was verified; clustered = both
    end up in the same duplicate cluster), precision of verified pairs and of clustered pairs."""
    cand = set(map(tuple, candidate_pairs))
    rep = np.arange(len(records)) if rep is None else np.asarray(rep)

    def is_candidate(i: int, j: int) -> bool:  # exact duplicates are found without LSH, via their representative
        a, b = int(rep[i]), int(rep[j])
        return a == b or (min(a, b), max(a, b)) in cand

    truth_map = {(i, j): jv for i, j, jv in truth}
    buckets = {"J>=0.85": (0.85, 1.01), "0.80<=J<0.85": (0.80, 0.85)}
    res: dict = {}
    for name, (lo, hi) in buckets.items():
        pairs = [(i, j) for (i, j), jv in truth_map.items() if lo <= jv < hi]
        direct = sum(1 for i, j in pairs if is_candidate(i, j))
        clustered = sum(1 for i, j in pairs if cluster_of[i] == cluster_of[j])
        res[name] = {
            "pairs": len(pairs),
            "recall_direct": direct / len(pairs) if pairs else None,
            "recall_clustered": clustered / len(pairs) if pairs else None,
        }
    ver = [tuple(p) for p in verified_pairs]
    good = 0
    for i, j in ver:
        a, b = min(i, j), max(i, j)
        jv = truth_map.get((a, b))
        if jv is None:
            jv = true_jaccard(records, a, b, spec)
        good += jv >= threshold
    res["precision_verified_pairs"] = good / len(ver) if ver else None
    res["verified_pairs"] = len(ver)
    return res


def evaluate_dedup(records: list[dict], workdir: str, **cfg_kwargs) -> dict:
    """Run the real file-based pipeline on ``records`` and score it against the ground truth."""
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, "corpus.jsonl")
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    out = os.path.join(workdir, "out")
    cfg = DedupConfig(inputs=[path], output_dir=out, progress=False, keep_work=True, force=True, **cfg_kwargs)
    report = run_dedup(cfg)
    work = os.path.join(out, WORK_DIR_NAME)
    n = len(records)
    bdir = os.path.join(work, "buckets")
    codes = np.unique(np.concatenate([np.load(os.path.join(bdir, f)) for f in sorted(os.listdir(bdir))]))
    cand = {tuple(p) for p in decode_pairs(codes, n).tolist()}
    verified = []
    vdir = os.path.join(work, "verify")
    for f in sorted(os.listdir(vdir)):
        with np.load(os.path.join(vdir, f)) as z:
            verified += z["edges"].tolist()
    keeper = np.load(os.path.join(work, "clusters", "keeper.npy"))
    truth = ground_truth_pairs(records, cfg.shingle)
    spec = cfg.shingle
    # exact duplicates never enter LSH; they are represented by their first occurrence
    rep = np.arange(n)
    first: dict[object, int] = {}
    for i, r in enumerate(records):
        key = tuple(normalize_words(r["text"])) if spec.kind == "word" else normalize_chars(r["text"])
        rep[i] = first.setdefault(key, i)
    res = accuracy(records, truth, cand, verified, keeper, cfg.threshold, spec, rep)
    res["report"] = report
    return res


# ----------------------------------------------------------------------------------------------------------
# Decontamination corpora


def make_tasks_and_training(
    n_tasks: int,
    n_docs: int,
    seed: int = 0,
    doc_chars: int = 3600,
    task_words: tuple[int, int] = (14, 40),
    short_task_fraction: float = 0.1,
    plant_fraction: float = 0.05,
) -> tuple[list[dict], list[dict]]:
    """Tasks ``{"task", "text"}`` (some 8-12 words, used whole) and training docs ``{"id", "text"}`` in which
    ``plant_fraction`` of the documents contain a verbatim task passage."""
    gen = TextGenerator(seed)
    rng = gen.rng
    tasks = []
    names = ["lambada", "squad", "triviaqa", "piqa", "race"]
    for t in range(n_tasks):
        if rng.random() < short_task_fraction:
            n = int(rng.integers(8, 13))
        else:
            n = int(rng.integers(task_words[0], task_words[1] + 1))
        toks = gen.words(n)
        toks[0] = toks[0].capitalize()
        tasks.append({"task": names[t % len(names)], "text": " ".join(toks) + "?"})
    docs = []
    for i in range(n_docs):
        paras = gen.document(int(doc_chars * rng.uniform(0.6, 1.4)))
        if rng.random() < plant_fraction:
            t = tasks[int(rng.integers(0, len(tasks)))]["text"]
            p = int(rng.integers(0, len(paras)))
            cut = int(rng.integers(0, len(paras[p]) + 1))
            paras[p] = paras[p][:cut] + t.split() + paras[p][cut:]
        docs.append({"id": f"train{i:07d}", "text": render(paras)})
    return tasks, docs
