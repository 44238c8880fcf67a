"""The runs behind ``mtnlg-quality``: annotate with heuristic signals, train the classifier, score, filter.

Every command reads JSON lines through :func:`read_documents` only, and writes OUT/<input name> atomically (one
output per input, records in input order, every field of the input kept). Inputs, OUT and the model may be URLs
(an output URL is written in a scratch folder and committed when complete: :mod:`mtnlg_lightning.corpora.commit`).
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Iterator

import numpy as np
from tqdm import tqdm

import mtnlg_lightning.corpora.storage as storage
from mtnlg_lightning.corpora.commit import Destination, destination, output_file
from mtnlg_lightning.corpora.jsonl import (
    InputError,
    atomic_write,
    check_input_files,
    dumps_line,
    iter_records,
    write_json_atomic,
)
from mtnlg_lightning.corpora.readers import batched
from mtnlg_lightning.crawl.classifier import QualityModel, keep_pareto, train

from . import heuristics

SIGNALS_KEY = "quality_signals"
FAILED_KEY = "quality_failed"
SCORE_KEY = "quality_score"


def read_documents(path: str, text_key: str = "text") -> Iterator[tuple[int, dict, str]]:
    """``(line number, record, text)`` of every document of a JSON lines file, validated (one-line errors naming
    file:line). The one place mtnlg-quality reads its inputs."""
    yield from iter_records(path, text_key)


def check_io(inputs: list[str], output_dir: str | None) -> None:
    check_input_files(inputs)
    if output_dir is None:
        return
    names: dict[str, str] = {}
    for path in inputs:
        name = storage.basename(path)
        if name in names:
            raise InputError(f"{path} and {names[name]} would both write {storage.join(output_dir, name)}")
        names[name] = path
        out = storage.join(output_dir, name)
        if out == path or (not storage.is_url(out) and os.path.abspath(out) == os.path.abspath(path)):
            raise InputError(f"{path}: the output would replace the input; choose another --output-dir")


def _bar(total: int, desc: str, progress: bool):
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, disable=not progress)


def _rewrite(inputs, output_dir, text_key, progress, desc, transform) -> dict:
    """Apply ``transform(record, text) -> record | None`` to every document; None drops it. Returns the count of
    documents in and out."""
    os.makedirs(output_dir, exist_ok=True)
    sizes = [storage.getsize(p) for p in inputs]
    bar = _bar(sum(sizes), desc, progress)
    documents = kept = 0
    for path, size in zip(inputs, sizes, strict=True):
        with atomic_write(os.path.join(output_dir, storage.basename(path)), "wb", fsync=True) as out:
            for _, record, text in read_documents(path, text_key):
                documents += 1
                result = transform(record, text)
                if result is not None:
                    kept += 1
                    out.write(dumps_line(result))
        bar.update(size)
    bar.close()
    return {"documents": documents, "kept": kept}


def _write_report(dest: Destination, inputs: list[str], command: str, t0: float, **figures) -> dict:
    """OUT/quality_<command>_report.json, written atomically, after the outputs (for a URL, all committed then):
    the command, its figures, the seconds since `t0`."""
    report = {"command": command, **figures, "seconds": round(time.perf_counter() - t0, 3)}
    name = f"quality_{command}_report.json"
    write_json_atomic(os.path.join(dest.local, name), report, fsync=True)
    dest.publish([storage.basename(p) for p in inputs] + [name])
    return report


# --- annotate ----------------------------------------------------------------------------------------------------


def annotate(inputs, output_dir, rule_settings: dict, text_key="text", progress=True) -> dict:
    """Add ``quality_signals`` (what the rules read) and ``quality_failed`` (the rules failed) to every document;
    nothing is dropped. Report: documents failing each rule (a document failing several rules counts under each)
    and documents failing any rule (counted once)."""
    check_io(inputs, output_dir)
    dest = destination(output_dir)
    t0 = time.perf_counter()
    per_rule: Counter = Counter({name: 0 for name in rule_settings})
    failing = Counter()

    def transform(record, text):
        signals = heuristics.measure(text)
        failed = heuristics.failed_rules(signals, rule_settings, str(record.get("language", "")))
        per_rule.update(failed)
        failing["any"] += bool(failed)
        return {**record, SIGNALS_KEY: signals, FAILED_KEY: failed}

    counts = _rewrite(inputs, dest.local, text_key, progress, "annotate", transform)
    return _write_report(
        dest,
        inputs,
        "annotate",
        t0,
        documents=counts["documents"],
        failing_any_rule=failing["any"],
        passing_every_rule=counts["documents"] - failing["any"],
        failing_by_rule=dict(per_rule),
        rules=rule_settings,
    )


# --- train / score -----------------------------------------------------------------------------------------------


def _texts(paths: list[str], text_key: str) -> list[str]:
    return [text for path in paths for _, _, text in read_documents(path, text_key)]


def binary_metrics(predicted: list[bool], actual: list[bool]) -> dict:
    tp = sum(p and a for p, a in zip(predicted, actual, strict=True))
    fp = sum(p and not a for p, a in zip(predicted, actual, strict=True))
    fn = sum(a and not p for p, a in zip(predicted, actual, strict=True))
    return {
        "precision": tp / max(1, tp + fp),
        "recall": tp / max(1, tp + fn),
        "accuracy": sum(p == a for p, a in zip(predicted, actual, strict=True)) / max(1, len(actual)),
    }


def train_model(
    positive: list[str],
    negative: list[str],
    model_path: str,
    text_key="text",
    holdout: float = 0.1,
    n_features: int = 1 << 18,
    max_ngram: int = 2,
    c: float = 1.0,
    seed: int = 0,
) -> dict:
    """Train on the positive (curated) and negative (raw crawl) documents; measure on a held-out share of each
    (chosen by ``seed``) before the final fit on everything; save the model."""
    check_io(positive + negative, None)
    t0 = time.perf_counter()
    pos, neg = _texts(positive, text_key), _texts(negative, text_key)
    if not pos or not neg:
        raise InputError("training needs at least one positive and one negative document")
    report: dict = {"command": "train", "positives": len(pos), "negatives": len(neg)}
    if holdout > 0:
        rng = np.random.default_rng(seed)
        pos_order, neg_order = rng.permutation(len(pos)), rng.permutation(len(neg))
        n_pos, n_neg = int(round(holdout * len(pos))), int(round(holdout * len(neg)))
        if n_pos and n_neg and n_pos < len(pos) and n_neg < len(neg):
            held = [pos[i] for i in pos_order[:n_pos]] + [neg[i] for i in neg_order[:n_neg]]
            trial = train(
                [pos[i] for i in pos_order[n_pos:]], [neg[i] for i in neg_order[n_neg:]], n_features, max_ngram, c, seed
            )
            predicted = [bool(s >= 0.5) for s in trial.scores(held)]
            report["holdout"] = {
                "documents": len(held),
                **binary_metrics(predicted, [True] * n_pos + [False] * n_neg),
            }
    model = train(pos, neg, n_features, max_ngram, c, seed)
    with output_file(model_path) as local:
        model.save(local)
    report.update(model=model_path, n_features=n_features, max_ngram=max_ngram, c=c, seed=seed)
    report["seconds"] = round(time.perf_counter() - t0, 3)
    return report


def score(inputs, output_dir, model_path: str, text_key="text", batch: int = 512, progress=True) -> dict:
    """Add ``quality_score`` (P(curated), in [0, 1]) to every document."""
    check_io(inputs, output_dir)
    model = load_model(model_path)
    dest = destination(output_dir)
    t0 = time.perf_counter()
    os.makedirs(dest.local, exist_ok=True)
    sizes = [storage.getsize(p) for p in inputs]
    bar = _bar(sum(sizes), "score", progress)
    documents = 0
    histogram = [0] * 10
    for path, size in zip(inputs, sizes, strict=True):
        with atomic_write(os.path.join(dest.local, storage.basename(path)), "wb", fsync=True) as out:
            for chunk in batched(read_documents(path, text_key), batch):
                documents += len(chunk)
                for (_, record, _), s in zip(chunk, model.scores([text for _, _, text in chunk]), strict=True):
                    histogram[min(9, int(s * 10))] += 1
                    out.write(dumps_line({**record, SCORE_KEY: round(float(s), 6)}))
        bar.update(size)
    bar.close()
    return _write_report(dest, inputs, "score", t0, documents=documents, score_histogram_tenths=histogram)


def load_model(path: str) -> QualityModel:
    if storage.is_url(path):
        if storage.info(path).is_dir:
            raise InputError(f"{path}: no such model file")
    elif not os.path.isfile(path):
        raise InputError(f"{path}: no such model file")
    try:
        return QualityModel.load(path)
    except (OSError, ValueError, KeyError) as err:
        raise InputError(f"{path}: not a quality model ({' '.join(str(err).split())})") from None


# --- filter ------------------------------------------------------------------------------------------------------


def filter_documents(
    inputs,
    output_dir,
    threshold: float | None = None,
    pareto_alpha: float | None = None,
    seed: int = 0,
    rule_settings: dict | None = None,
    text_key="text",
    progress=True,
    languages: tuple[str, ...] = (),
) -> dict:
    """Keep the documents that pass every criterion given: ``quality_score >= threshold``; GPT-3's Pareto rule;
    every heuristic rule of ``rule_settings`` (re-applied to the stored signals, measured here when absent); a
    ``language`` (from mtnlg-extract) among ``languages`` when any are given.
    Report: documents dropped by each criterion (a document failing several counts under each) and in total
    (once)."""
    check_io(inputs, output_dir)
    dest = destination(output_dir)
    t0 = time.perf_counter()
    dropped_by: Counter = Counter()
    if threshold is not None:
        dropped_by["below_threshold"] = 0
    if pareto_alpha is not None:
        dropped_by["pareto"] = 0
    if languages:
        dropped_by["language"] = 0
    for name in rule_settings or {}:
        dropped_by[f"rule:{name}"] = 0

    def transform(record, text):
        reasons = []
        if languages and record.get("language") not in languages:
            reasons.append("language")
        if threshold is not None or pareto_alpha is not None:
            s = record.get(SCORE_KEY)
            if not isinstance(s, int | float):
                raise InputError(f"a document has no numeric {SCORE_KEY!r}: run 'mtnlg-quality score' first")
            if threshold is not None and s < threshold:
                reasons.append("below_threshold")
            if pareto_alpha is not None and not keep_pareto(float(s), text, pareto_alpha, seed):
                reasons.append("pareto")
        if rule_settings is not None:
            signals = record.get(SIGNALS_KEY)
            if not isinstance(signals, dict):
                signals = heuristics.measure(text)
            reasons += [
                f"rule:{r}" for r in heuristics.failed_rules(signals, rule_settings, record.get("language", ""))
            ]
        dropped_by.update(reasons)
        return None if reasons else record

    counts = _rewrite(inputs, dest.local, text_key, progress, "filter", transform)
    return _write_report(
        dest,
        inputs,
        "filter",
        t0,
        documents=counts["documents"],
        kept=counts["kept"],
        dropped=counts["documents"] - counts["kept"],
        dropped_by=dict(dropped_by),
        threshold=threshold,
        pareto_alpha=pareto_alpha,
        languages=list(languages),
        seed=seed,
        rules=rule_settings,
    )
