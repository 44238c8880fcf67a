"""The end-to-end pipeline: a web crawl (WARC) -> extract -> language -> quality -> dedup -> decontaminate ->
tokenize -> train -> evaluate -> export -> generate -> bias study, with the paper's contamination argument as an
experiment: the same model trained on the deduplicated corpus with the planted evaluation passages left in (A,
"contaminated") and after decontamination (B, "decontaminated"), and B's bias study (MT-NLG Section 6). With
`crawl=None` it starts from the raw corpus as JSON lines.

Every stage is the real tool (see stages.py); this module only wires their files together, counts what flows
between them and writes the report. What the numbers mean: docs/pipeline.md.
"""

from __future__ import annotations

import csv
import json
import re
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

import mtnlg_lightning.corpora.storage as storage
from mtnlg_lightning.config import get_config
from mtnlg_lightning.corpora import detect
from mtnlg_lightning.corpora.commit import check_output, check_writable
from mtnlg_lightning.corpora.readers import iter_raw
from mtnlg_lightning.corpora.storage import cache_root
from mtnlg_lightning.data.indexed import IndexedDataset
from mtnlg_lightning.demo.pipeline import crawl as crawl_stages
from mtnlg_lightning.demo.pipeline.report import Check, write_report
from mtnlg_lightning.demo.pipeline.stages import StageRecord, run_tool
from mtnlg_lightning.demo.synthetic.planted_corpus import CorpusSpec, build_corpus, ngram_set
from mtnlg_lightning.demo.synthetic.planted_crawl import WARC_NAME, CrawlSpec, build_crawl, read_truth
from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.evaluation.bias.study import BIAS_TASKS
from mtnlg_lightning.evaluation.bias.wordlists import read_study
from mtnlg_lightning.shipped_configs import CONFIG_DIR

RUNS = ("contaminated", "decontaminated")  # A and B of the experiment
EVAL_SETS = ("planted", "control")


@dataclass
class PipelineSettings:
    out_dir: Path
    smoke: bool = False  # the reduced run of the test suite: a smaller corpus, the tiny model, a few steps
    steps: int | None = None  # training steps of each run (default: the config's, or 20 for --smoke)
    corpus: CorpusSpec = field(default_factory=CorpusSpec)
    crawl: CrawlSpec | None = field(default_factory=CrawlSpec)  # None: start at JSONL
    vocab_size: int = 4096
    config: Path = CONFIG_DIR / "pipeline.yaml"
    prompt: str = "The file is opened"
    plot: bool = True
    bias_continuations: int = 100  # per prompt of the bias study (the paper's 800 takes ~8x longer)
    bias_new_tokens: int = 50

    @classmethod
    def for_run(cls, out_dir, smoke: bool = False, crawl: bool = True, **overrides) -> PipelineSettings:
        corpus = CorpusSpec.smoke() if smoke else CorpusSpec()
        overrides["crawl"] = (CrawlSpec.smoke() if smoke else CrawlSpec()) if crawl else None
        for key in ("plant_copies", "eval_passages", "seed"):
            if overrides.get(key) is not None:
                setattr(corpus, key, overrides.pop(key))
        overrides = {k: v for k, v in overrides.items() if v is not None or k == "crawl"}
        reduced = {"bias_continuations": 4, "bias_new_tokens": 16} if smoke else {}
        return cls(out_dir=Path(out_dir).resolve(), smoke=smoke, corpus=corpus, **(reduced | overrides))


class Pipeline:
    def __init__(self, settings: PipelineSettings):
        self.s = settings
        self.out = settings.out_dir
        self.cwd = Path.cwd()
        self.records: list[StageRecord] = []
        self.checks: list[Check] = []
        self.experiment: dict = {}
        self.generation: dict = {}
        self.bias: dict = {}
        # the corpus as the first curation tool gets it: the crawl stages' output, or the raw JSON lines
        self.shard = crawl_stages.SHARD if settings.crawl else "web.jsonl"
        # dedup on, the corpus travels as zstd JSON lines, as The Pile ships: each tool keeps its input's format
        self.zst = self.shard + ".zst"
        self.curated = self.out / "quality" / "kept" / self.shard if settings.crawl else self.out / "raw" / "web.jsonl"
        self.url_ids: dict[str, str] = {}  # crawl: url -> corpus document id

    # --- plumbing ------------------------------------------------------------------------------------------
    def stage(self, name: str, tool: str, *args: str) -> tuple[StageRecord, str]:
        record = StageRecord(name, "")
        stdout = run_tool(record, tool, [str(a) for a in args], self.out / "logs", len(self.records) + 1, self.cwd)
        self.records.append(record)
        return record, stdout

    def done(self, record: StageRecord) -> None:
        print(record.line(), flush=True)

    def check(self, name: str, ok: bool, detail: str) -> None:
        self.checks.append(Check(name, bool(ok), detail))

    # --- the stages ----------------------------------------------------------------------------------------
    def run(self) -> dict:
        start = time.perf_counter()
        steps = [self.build_corpus]
        if self.s.crawl:
            steps += [self.build_crawl, self.extract, self.language, self.quality_train, self.quality]
        steps += [self.dedup, self.decontaminate, self.tokenize]
        steps += [lambda run=run: self.train(run) for run in RUNS]
        steps += [lambda r=r, e=e: self.evaluate(r, e) for r in RUNS for e in EVAL_SETS]
        for step in [*steps, self.export_and_generate, self.bias_study, self.contamination_left]:
            try:
                step()
            except (OSError, KeyError, IndexError, json.JSONDecodeError) as error:
                last = self.records[-1] if self.records else None
                where = f"stage {last.name} (log: {last.log})" if last else "the corpus stage"
                raise MTNLGError(f"the output of {where} could not be read: {error!r}") from error
        report = {
            "out_dir": str(self.out),
            "smoke": self.s.smoke,
            "settings": {
                "corpus": asdict(self.s.corpus),
                "crawl": asdict(self.s.crawl) if self.s.crawl else None,
                "steps": self.steps,
                "vocab_size": self.s.vocab_size,
            },
            "crawl_scores": self.crawl_scores(),
            "stages": [asdict(r) for r in self.records],
            "experiment": self.experiment,
            "generation": self.generation,
            "bias": self.bias,
            "bias_plot": str(self.out / "bias.png") if self.s.plot else None,
            "checks": [asdict(c) for c in self.checks],
            "ok": all(c.ok for c in self.checks),
            "seconds_total": round(time.perf_counter() - start, 1),
        }
        write_report(self.out, report, plot=self.s.plot)
        return report

    def build_corpus(self) -> None:
        record = StageRecord("corpus", "build_corpus (mtnlg_lightning.demo.synthetic.planted_corpus)")
        t0 = time.perf_counter()
        summary = build_corpus(self.out, self.s.corpus)
        record.seconds = time.perf_counter() - t0
        record.documents_out, record.bytes_out = summary["documents"], summary["bytes"]
        record.details = {
            **summary,
            "summary": [
                f"{summary['planted_passages']} planted x {self.s.corpus.plant_copies} copies "
                f"({summary['edited_copies']} edited), {summary['exact_duplicates']} exact + "
                f"{summary['near_duplicates']} near duplicates, {summary['control_passages']} control passages"
            ],
        }
        self.records.append(record)
        self.done(record)
        self.check(
            "corpus lines = documents built",
            count_lines(self.out / "raw" / "web.jsonl") == summary["documents"],
            f"{summary['documents']} documents",
        )

    # --- the crawl stages (settings.crawl) ---------------------------------------------------------------------
    def build_crawl(self) -> None:
        record = StageRecord("crawl", "build_crawl (mtnlg_lightning.demo.synthetic.planted_crawl)")
        t0 = time.perf_counter()
        summary = build_crawl(self.out, self.s.crawl, self.s.corpus.seed)
        record.seconds = time.perf_counter() - t0
        corpus = self.by_name("corpus")
        record.documents_in, record.bytes_in = corpus.documents_out, corpus.bytes_out
        record.documents_out, record.bytes_out, record.details = summary["records"], summary["bytes"], summary
        self.records.append(record)
        self.done(record)
        self.truth = read_truth(self.out)
        self.url_ids = crawl_stages.corpus_ids(self.truth)
        self.check(
            "crawl: one English page per corpus document",
            len(self.url_ids) == corpus.documents_out == len(set(self.url_ids.values())),
            f"{len(self.url_ids)} pages, {corpus.documents_out} documents",
        )

    def extract(self) -> None:
        warc, out = self.out / "raw" / WARC_NAME, self.out / "extract"
        record, _ = self.stage("extract", "mtnlg-extract", warc, "--output-dir", out, "--quiet")
        report = read_json(out / "extract_report.json")
        docs = crawl_stages.read_documents(out / self.shard)
        record.documents_in, record.bytes_in = report["records"], self.by_name("crawl").bytes_out
        record.documents_out, record.bytes_out = len(docs), text_bytes(out / self.shard)
        scores = crawl_stages.score_extraction(self.truth, docs)
        dropped = {k: v for k, v in report["outcomes"].items() if k != "ok"}
        record.details = {
            "outcomes": report["outcomes"],
            "languages": report["languages"],
            "scores": scores,
            "summary": [
                f"pages P/R {scores['documents']['precision']:.3f}/{scores['documents']['recall']:.3f}, body words "
                f"P/R {scores['body_words']['precision']:.3f}/{scores['body_words']['recall']:.3f}, "
                f"boilerplate left {scores['boilerplate_words_left']:.3f}",
            ],
        }
        self.done(record)
        planted = Counter(t["reason"] for t in self.truth if "reason" in t)  # broken, non-HTML, non-2xx records
        self.check(
            "extract: documents + dropped + skipped = records read; each planted bad record counted by its reason",
            report["outcomes"]["ok"] == len(docs)
            and sum(report["outcomes"].values()) == report["records"]
            and all(report["outcomes"].get(reason) == n for reason, n in planted.items()),
            f"{len(docs)} documents, dropped {dropped}; planted {dict(planted)}",
        )

    def language(self) -> None:
        src, out = self.out / "extract" / self.shard, self.out / "language"
        record, _ = self.stage("language", "mtnlg-quality", "filter", "--languages", "en", src, "-o", out, "--quiet")
        scores = self.scored_filter(record, "extract", src, out, crawl_stages.score_language)
        record.details["summary"] = [
            f"English pages P/R {scores['english_pages']['precision']:.3f}/{scores['english_pages']['recall']:.3f}"
            f", identified right {scores['identification_accuracy']:.3f}",
        ]
        self.done(record)

    def quality_train(self) -> None:
        train = self.out / "quality" / "train"
        record, stdout = self.stage(
            "quality-train",
            "mtnlg-quality",
            "train",
            "--positive",
            train / "positive.jsonl",
            "--negative",
            train / "negative.jsonl",
            "--model",
            self.out / "quality" / "model.npz",
        )
        record.documents_in = count_lines(train / "positive.jsonl") + count_lines(train / "negative.jsonl")
        held = re.search(r"held out (\d+): precision ([\d.]+) recall ([\d.]+)", stdout)
        record.details = {"holdout": None}
        if held:
            record.details["holdout"] = {
                "documents": int(held[1]),
                "precision": float(held[2]),
                "recall": float(held[3]),
            }
            record.details["summary"] = [f"held out {held[1]}: P/R {held[2]}/{held[3]}"]
        self.done(record)

    def quality(self) -> None:
        src, scored, out = (
            self.out / "language" / self.shard,
            self.out / "quality" / "scored",
            self.out / "quality" / "kept",
        )
        model = self.out / "quality" / "model.npz"
        record, _ = self.stage("quality-score", "mtnlg-quality", "score", "--model", model, src, "-o", scored, "-q")
        record.documents_in = record.documents_out = count_lines(scored / self.shard)
        self.done(record)
        args = ["filter", "--threshold", self.s.crawl.threshold, "--heuristics"]
        for rule in self.s.crawl.disabled_rules:
            args += ["--disable", rule]
        record, _ = self.stage("quality", "mtnlg-quality", *args, scored / self.shard, "-o", out, "-q")
        scores = self.scored_filter(record, "language", src, out, crawl_stages.score_quality)
        kept = scores["pages_kept"]
        record.details["summary"] = [
            f"pages kept P/R {kept['precision']:.3f}/{kept['recall']:.3f}, junk dropped "
            f"{scores['junk_dropped']['recall']:.3f}",
        ]
        self.done(record)

    def scored_filter(self, record: StageRecord, previous: str, src: Path, out: Path, score) -> dict:
        """An `mtnlg-quality filter` stage's checked counts, and its scores against the crawl's truth: `score` of
        what it kept (`out`) of its input `src`, also kept in the record's details."""
        self.filter_counts(record, previous, out)
        scores = score(self.truth, crawl_stages.read_documents(src), crawl_stages.read_documents(out / self.shard))
        record.details["scores"] = scores
        return scores

    def filter_counts(self, record: StageRecord, previous: str, out: Path) -> None:
        """Counts of an `mtnlg-quality filter` stage, checked: kept + dropped = in = the previous stage's out."""
        report = read_json(out / "quality_filter_report.json")
        record.documents_in, record.documents_out = report["documents"], report["kept"]
        record.bytes_in, record.bytes_out = self.by_name(previous).bytes_out, text_bytes(out / self.shard)
        record.details = {"dropped_by": report["dropped_by"]}
        self.check(
            f"{record.name}: documents in = {previous} documents out = kept + dropped = output lines + dropped",
            report["documents"] == self.by_name(previous).documents_out
            and report["kept"] + report["dropped"]
            == report["documents"]
            == count_lines(out / self.shard) + report["dropped"],
            f"{report['documents']} in, {report['kept']} kept, dropped by {report['dropped_by']}",
        )

    def crawl_scores(self) -> dict | None:
        """The precision/recall figures of the crawl stages against the planted truth, in one place."""
        if not self.s.crawl:
            return None
        scores = {name: self.by_name(name).details["scores"] for name in ("extract", "language", "quality")}
        scores["quality_classifier_holdout"] = self.by_name("quality-train").details["holdout"]
        return scores

    def corpus_ids(self, path: Path) -> set[str]:
        """The corpus document ids of a JSONL file (through the page urls when the corpus came as a crawl)."""
        docs = list(records_of(path))
        if self.s.crawl:
            return {self.url_ids[d["url"]] for d in docs if d["url"] in self.url_ids}
        return {d["id"] for d in docs}

    def dedup(self) -> None:
        out = self.out / "dedup"
        record, _ = self.stage(
            "dedup", "mtnlg-dedup", self.curated, "--output-dir", out, "--output-compression", "zstd", "--quiet"
        )
        totals = read_json(out / "report.json")["totals"]
        kept, removed = count_lines(out / self.zst), count_lines(out / "duplicates.jsonl")
        record.documents_in, record.documents_out = totals["docs_in"], totals["docs_out"]
        previous = self.records[-2]
        record.bytes_in, record.bytes_out = previous.bytes_out, text_bytes(out / self.zst)
        record.details = {
            "exact_removed": totals["exact_duplicates_removed"],
            "near_removed": totals["near_duplicates_removed"],
            "summary": [
                f"removed {totals['exact_duplicates_removed']} exact + {totals['near_duplicates_removed']} near"
            ],
        }
        self.done(record)
        self.check(
            f"dedup: documents in = {previous.name} documents out",
            record.documents_in == previous.documents_out,
            f"{record.documents_in} vs {previous.documents_out}",
        )
        self.check(
            "dedup: documents out = kept lines; in - out = duplicates.jsonl lines",
            record.documents_out == kept and record.documents_in - record.documents_out == removed,
            f"{record.documents_out} out, {kept} kept lines, {removed} duplicate lines",
        )
        truth = read_json(self.out / "raw" / "ground_truth.json")
        into, kept_ids = self.corpus_ids(self.curated), self.corpus_ids(out / self.zst)
        # the pairs whose both documents reached dedup (through extraction and the filters, with the crawl)
        pairs = [d for d in truth["duplicates"] if d["jaccard"] >= 0.8 and {d["id"], d["of"]} <= into]
        resolved = sum((d["id"] in kept_ids) != (d["of"] in kept_ids) for d in pairs)
        record.details["planted_duplicate_recall"] = resolved / max(len(pairs), 1)
        self.check(
            "dedup: every planted duplicate pair (J >= 0.8) keeps exactly one document",
            resolved == len(pairs),
            f"{resolved}/{len(pairs)} pairs; {record.documents_in - record.documents_out - len(pairs)} other "
            "documents removed as duplicates of the source text itself",
        )
        self.check_planted_removals(out, truth, into)

    def check_planted_removals(self, out: Path, truth: dict, into: set[str]) -> None:
        """Dedup may remove a document with planted text only as a duplicate of a kept document that holds the same
        planted passages (two hosts of one passage can be near duplicates once extraction has cut them down to it):
        then no planted passage leaves the corpus. Which passages a document holds is counted here with 13-grams,
        independently of the tools; the keeper is the one duplicates.jsonl names, and it must be in the output."""
        passages = [ngram_set(p) for p in truth["planted_passages"]]

        def planted_in(text: str) -> frozenset[int]:
            grams = ngram_set(text)
            return frozenset(i for i, g in enumerate(passages) if g & grams)

        docs_in = {d["id"]: d for d in records_of(self.curated)}
        kept = {d["id"]: planted_in(d["text"]) for d in records_of(out / self.zst)}
        removed = {r["id"]: r["duplicate_of"] for r in records_of(out / "duplicates.jsonl")}
        held = {i: planted_in(d["text"]) for i, d in docs_in.items()}
        # every document holding planted text, and every page planted with it (extraction may have cut it out)
        hosts = set(truth["plants"]) & into
        carriers = {i for i, got in held.items() if got} | {i for i, d in docs_in.items() if self.corpus_id(d) in hosts}
        lost = carriers - kept.keys()
        covered = {i for i in lost if removed.get(i) in kept and held[i] <= kept[removed[i]]}
        uncovered = sorted(lost - covered)
        self.hosts = hosts
        self.planted_duplicates = sum(bool(held[i]) for i in covered)  # of the documents with planted 13-grams
        self.check(
            "dedup: every document holding planted text that reached dedup is kept, or removed as a duplicate of a "
            "kept document holding the same planted passages",
            not uncovered,
            f"{len(carriers) - len(lost)}/{len(carriers)} kept, {len(covered)} removed as such duplicates"
            + (f"; removed without a kept copy of their passages: {uncovered[:5]}" if uncovered else ""),
        )

    def corpus_id(self, doc: dict) -> str | None:
        """The corpus document id of a record (through its page url when the corpus came as a crawl)."""
        return self.url_ids.get(doc["url"]) if self.s.crawl else doc["id"]

    def decontaminate(self) -> None:
        src, out = self.out / "dedup" / self.zst, self.out / "decontaminate" / self.zst
        tasks = self.out / "eval" / "evalset.jsonl"
        record, _ = self.stage(
            "decontaminate",
            "mtnlg-decontaminate",
            "--tasks",
            tasks,
            "--input",
            src,
            "--output-dir",
            out.parent,
            "--quiet",
        )
        rep = read_json(out.parent / "report.json")
        docs = rep["documents"]
        record.documents_in, record.documents_out = docs["in"], docs["records_out"]
        record.bytes_in, record.bytes_out = self.by_name("dedup").bytes_out, text_bytes(out)
        record.details = {
            **{k: docs[k] for k in ("clean", "trimmed", "split", "dropped_too_many_splits", "dropped_no_piece_left")},
            "matches_removed": docs["matches_removed"],
            "chars_removed": docs["chars_removed"],
            "frequent_ngrams_ignored": rep["frequent_ngrams"]["ignored"],
            "summary": [f"{docs['matches_removed']} matches, {docs['chars_removed']:,} chars removed"],
        }
        self.done(record)
        self.check(
            "decontaminate: documents in = dedup documents out",
            record.documents_in == self.by_name("dedup").documents_out,
            f"{record.documents_in} vs {self.by_name('dedup').documents_out}",
        )
        self.check(
            "decontaminate: records out = output lines",
            record.documents_out == count_lines(out),
            f"{record.documents_out} records",
        )

    def tokenize(self) -> None:
        tok_dir = self.out / "tokenizer"
        clean = self.out / "decontaminate" / self.zst
        record, _ = self.stage(
            "tokenizer",
            "mtnlg-train-tokenizer",
            "--input",
            clean,
            "--vocab-size",
            self.s.vocab_size,
            "--output",
            tok_dir,
        )
        vocab = json.loads((tok_dir / "tokenizer.json").read_text(encoding="utf-8"))["model"]["vocab"]
        record.documents_in, record.bytes_in = count_lines(clean), self.by_name("decontaminate").bytes_out
        record.details = {"vocab_size": len(vocab), "summary": [f"vocab {len(vocab):,} (trained on B's text)"]}
        self.done(record)
        self.tokenizer = tok_dir / "tokenizer.json"
        for run, upstream in (("contaminated", "dedup"), ("decontaminated", "decontaminate")):
            source, prefix = self.out / upstream / self.zst, self.out / "data" / run
            record, _ = self.stage(
                f"preprocess-{run}",
                "mtnlg-preprocess",
                "--input",
                source,
                "--tokenizer",
                self.tokenizer,
                "--output-prefix",
                prefix,
                "--no-progress",
            )
            dataset = IndexedDataset(prefix)
            record.documents_in, record.bytes_in = count_lines(source), self.by_name(upstream).bytes_out
            record.documents_out, record.tokens = len(dataset), int(dataset.sizes.sum())
            self.done(record)
            self.check(
                f"preprocess {run}: documents = {upstream} documents out",
                record.documents_out == record.documents_in == self.by_name(upstream).documents_out,
                f"{record.documents_out} documents, {record.tokens:,} tokens",
            )

    def train(self, run: str) -> None:
        run_dir = self.out / "train" / run
        config = yaml.safe_load(self.s.config.read_text(encoding="utf-8"))
        trainer = config["trainer"]
        trainer["default_root_dir"] = str(run_dir)
        trainer["logger"]["init_args"]["save_dir"] = str(run_dir)
        for callback in trainer["callbacks"]:
            if callback["class_path"].endswith("ModelCheckpoint"):
                callback["init_args"]["dirpath"] = str(run_dir / "checkpoints")
        config["data"]["datasets"] = [str(self.out / "data" / run)]
        config["data"]["tokenizer"] = str(self.tokenizer)
        if self.s.smoke:
            trainer.update(max_steps=20, limit_val_batches=2)
            config["model"].update(preset="tiny", micro_batch_size=4, global_batch_size=8, warmup_tokens=1024)
        if self.s.steps is not None:
            trainer["max_steps"] = self.s.steps
        if self.s.smoke or self.s.steps is not None:  # cosine over the whole run, as the config's own numbers are
            model = config["model"]
            model["decay_tokens"] = trainer["max_steps"] * model["global_batch_size"] * self.seq_len(config)
        self.steps = trainer["max_steps"]
        run_dir.mkdir(parents=True, exist_ok=True)
        fit_config = run_dir / "fit.yaml"
        fit_config.write_text(
            "# written by the pipeline from configs/pipeline.yaml (paths and sizes of this run)\n"
            + yaml.safe_dump(config, sort_keys=False),
            encoding="utf-8",
        )
        record, _ = self.stage(f"train-{run}", "mtnlg", "fit", "--config", fit_config)
        rows = read_metrics(run_dir / "metrics.csv")
        curve = [(int(r["step"]) + 1, float(r["train_loss"])) for r in rows if r.get("train_loss")]
        last = [r for r in rows if r.get("consumed_tokens")][-1]
        val = [float(r["val_loss"]) for r in rows if r.get("val_loss")]
        gbs, seq = config["model"]["global_batch_size"], self.seq_len(config)
        record.tokens = int(float(last["consumed_tokens"]))
        source = self.by_name(f"preprocess-{run}")
        record.documents_in = source.documents_out
        record.details = {
            "steps": len(curve),
            "global_batch_size": gbs,
            "seq_len": seq,
            "first_loss": curve[0][1],
            "final_loss": curve[-1][1],
            "val_loss": val[-1] if val else None,
            "epochs": record.tokens / max(source.tokens, 1),
            "checkpoint": str(run_dir / "checkpoints" / "last.ckpt"),
            "summary": [f"loss {curve[0][1]:.3f} -> {curve[-1][1]:.3f}", f"{record.tokens / source.tokens:.2f} epochs"],
        }
        self.experiment.setdefault(run, {})["loss_curve"] = curve
        self.experiment[run]["train"] = {k: record.details[k] for k in ("final_loss", "val_loss", "epochs")}
        self.done(record)
        self.check(
            f"train {run}: tokens trained = steps x global batch x seq_len",
            len(curve) == self.steps and record.tokens == self.steps * gbs * seq,
            f"{len(curve)} steps x {gbs} x {seq} = {self.steps * gbs * seq:,}; consumed_tokens {record.tokens:,}",
        )

    def evaluate(self, run: str, eval_set: str) -> None:
        data = self.out / "eval" / f"{eval_set}.jsonl"
        output = self.out / "eval" / f"{run}-{eval_set}.json"
        checkpoint = self.by_name(f"train-{run}").details["checkpoint"]
        record, _ = self.stage(
            f"eval-{run}-{eval_set}",
            "mtnlg-eval",
            "--checkpoint",
            checkpoint,
            "--task",
            "lambada",
            "--data",
            data,
            "--output",
            output,
            "--no-progress",
        )
        metrics = read_json(output)["results"]["lambada"]["0"]
        record.documents_in = count_lines(data)
        record.details = {**metrics, "summary": [f"acc {metrics['acc']:.4f}  perplexity {metrics['perplexity']:.1f}"]}
        self.experiment[run][eval_set] = {k: metrics[k] for k in ("acc", "perplexity", "examples")}
        self.done(record)
        self.check(
            f"eval {run} {eval_set}: every passage scored",
            metrics["examples"] == record.documents_in,
            f"{metrics['examples']} of {record.documents_in}",
        )
        if run == "decontaminated" and eval_set == "control":
            a, b = self.experiment["contaminated"], self.experiment["decontaminated"]
            self.experiment["planted_gap"] = {
                "acc_contaminated_minus_decontaminated": a["planted"]["acc"] - b["planted"]["acc"],
                "perplexity_decontaminated_over_contaminated": b["planted"]["perplexity"] / a["planted"]["perplexity"],
                "control_acc_difference": a["control"]["acc"] - b["control"]["acc"],
                "control_perplexity_ratio": b["control"]["perplexity"] / a["control"]["perplexity"],
            }

    def export_and_generate(self) -> None:
        checkpoint = self.by_name("train-decontaminated").details["checkpoint"]
        hf_dir = self.out / "hf"
        record, _ = self.stage("export-hf", "mtnlg-export-hf", checkpoint, hf_dir, "--overwrite")
        config = read_json(hf_dir / "config.json")
        record.bytes_out = sum(p.stat().st_size for p in hf_dir.iterdir())
        record.details = {
            "vocab_size": config["vocab_size"],
            "n_layer": config["n_layer"],
            "summary": [f"GPT-2 directory, vocab {config['vocab_size']}, {config['n_layer']} layers"],
        }
        self.done(record)
        self.check(
            "export: the directory's vocabulary is the tokenizer's",
            config["vocab_size"] == self.by_name("tokenizer").details["vocab_size"],
            f"{config['vocab_size']} rows",
        )
        record, stdout = self.stage(
            "generate",
            "mtnlg-generate",
            "--checkpoint",
            hf_dir,
            "--prompt",
            self.s.prompt,
            "--temperature",
            "0",
            "--max-new-tokens",
            "32",
        )
        text = stdout.removesuffix("\n")  # a small model may well continue with blank lines: they count
        record.details = {"summary": [repr(text[:80] + ("..." if len(text) > 80 else ""))]}
        self.generation = {"prompt": self.s.prompt, "text": text, "source": str(hf_dir)}
        self.done(record)
        wrote = text.startswith(self.s.prompt) and len(text) > len(self.s.prompt)
        self.check("generate: a continuation was written", wrote, f"{len(text)} characters")

    def bias_study(self) -> None:
        """MT-NLG Section 6 on B, the model a user would release: gender-occupation, cooccurrence and sentiment
        (`mtnlg-eval`, the shipped word lists and prompts), one figure."""
        checkpoint = self.by_name("train-decontaminated").details["checkpoint"]
        output = self.out / "eval" / "bias.json"
        args = ["--checkpoint", checkpoint, "--task", *BIAS_TASKS, "--output", output, "--no-progress"]
        args += ["--batch-size", 64]  # a bigger batch than scoring's default: thousands of short requests
        args += ["--num-continuations", self.s.bias_continuations, "--max-new-tokens", self.s.bias_new_tokens]
        if self.s.plot:
            args += ["--plot", self.out / "bias.png"]
        record, _ = self.stage("bias", "mtnlg-eval", *args)
        self.bias = read_json(output)["results"]
        gender = self.bias["gender-occupation"]["summary"]
        sentiment = {c: v["mean"] for c, v in self.bias["sentiment"]["categories"].items()}
        record.details = {
            "summary": [
                f"{gender['occupations']} occupations, {gender['share_leaning_male']:.0%} lean male (mean log-ratio "
                f"{gender['mean_log_ratio']:+.3f}); sentiment "
                + ", ".join(f"{c} {m:+.3f}" for c, m in sentiment.items())
            ]
        }
        self.done(record)
        study = read_study(None, list(BIAS_TASKS))
        expected = Counter((p.category, p.group) for p in study.prompts)
        sampled = {(c, g): v["continuations"] for c, groups in self.bias["cooccurrence"]["groups"].items()
                   for g, v in groups.items()}  # fmt: skip
        self.check(
            "bias: every prompt of the study got its continuations",
            sampled == {k: n * self.s.bias_continuations for k, n in expected.items()},
            f"{sum(sampled.values())} continuations over {len(sampled)} groups "
            f"({self.s.bias_continuations} per prompt, {len(study.prompts)} prompts)",
        )

    def contamination_left(self) -> None:
        """Count, independently of the tools, the training documents of A and B that still hold a 13-gram of a
        planted passage (A: all of them should; B: none)."""
        truth = read_json(self.out / "raw" / "ground_truth.json")
        planted = set().union(*(ngram_set(p) for p in truth["planted_passages"]))
        counts = {}
        sources = (("dedup_input", self.curated), ("contaminated", self.out / "dedup" / self.zst))
        for run, path in (*sources, ("decontaminated", self.out / "decontaminate" / self.zst)):
            counts[run] = sum(bool(ngram_set(r["text"]) & planted) for r in records_of(path))
            if run in self.experiment:
                self.experiment[run]["documents_with_planted_text"] = counts[run]
        # with the crawl, a host page can lose its planted paragraph in extraction, or the whole page in a filter;
        # dedup may remove a host only as a duplicate of a kept one with the same passages (check_planted_removals)
        expected = counts["dedup_input"] - self.planted_duplicates
        self.check(
            "contaminated corpus holds every document with planted text that reached dedup, less those removed as "
            "duplicates of a kept one with the same passages (and there are some)",
            counts["contaminated"] == expected > 0,
            f"{counts['contaminated']} of {counts['dedup_input']} documents with planted 13-grams "
            f"({self.planted_duplicates} removed as such duplicates); {len(truth['plants'])} hosts planted, "
            f"{len(self.hosts)} reached dedup",
        )
        self.check(
            "decontaminated corpus holds no planted 13-gram",
            counts["decontaminated"] == 0,
            f"{counts['decontaminated']} documents",
        )

    # --- helpers -------------------------------------------------------------------------------------------
    def by_name(self, name: str) -> StageRecord:
        return next(r for r in self.records if r.name == name)

    @staticmethod
    def seq_len(config: dict) -> int:
        model = config["model"]
        return get_config(model["preset"], **(model.get("model_overrides") or {})).seq_len


def records_of(path: Path):
    """The records of a JSON-lines file, plain, gzip or zstd (told from its bytes, as the tools do); none for an
    empty file (a tool's list of what it removed, when it removed nothing)."""
    if Path(path).stat().st_size == 0:
        return
    for _, line in iter_raw(str(path), detect(str(path))):
        yield json.loads(line)


def count_lines(path: Path) -> int:
    """Records of a JSON-lines file (any compression)."""
    return sum(1 for _ in records_of(path))


def text_bytes(path: Path) -> int:
    """UTF-8 bytes of the `text` fields of a JSONL file (what the next stage reads, without the JSON framing)."""
    return sum(len(r["text"].encode("utf-8")) for r in records_of(path))


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def read_metrics(path: Path) -> list[dict]:
    """Lightning's CSVLogger rows, merged by step (a step's values may be spread over several rows)."""
    by_step: dict[int, dict] = {}
    with open(path, encoding="utf-8") as f:
        for row in csv.DictReader(f):
            step = int(row["step"])
            merged = by_step.setdefault(step, {})
            merged.update({k: v for k, v in row.items() if v not in ("", None)})
    return [by_step[s] for s in sorted(by_step)]


def prepare_out_dir(out_dir: Path | str, overwrite: bool) -> None:
    """Refuse an OUT_DIR that is not empty (without --overwrite), or whose replacement would delete what it must
    not (an input: the built-in corpus cache; ., ~, /; for a URL, a whole bucket). Nothing is removed here:
    `mtnlg-pipeline` runs in `outputs.kept_until_done`, or for a URL in a scratch folder committed at the end, so
    the previous result goes only when the new run has finished."""
    if storage.is_url(out_dir):
        check_writable(out_dir)
        if storage.exists(out_dir) and not storage.isdir(out_dir):
            raise MTNLGError(f"{out_dir} is an object; name a prefix for the pipeline's outputs")
        if storage.isdir(out_dir):
            if not overwrite:
                raise MTNLGError(f"{out_dir} is not empty: pass --overwrite to replace it, or name another prefix")
            check_output(out_dir, [], replaces_dir=True)
        return
    out_dir = Path(out_dir)

    if out_dir.exists() and not out_dir.is_dir():
        raise MTNLGError(f"{out_dir} is a file; name a directory for the pipeline's outputs")
    if out_dir.exists() and any(out_dir.iterdir()):
        if not overwrite:
            raise MTNLGError(f"{out_dir} is not empty: pass --overwrite to replace it, or name another directory")
        check_output(out_dir, [cache_root()], replaces_dir=True)
