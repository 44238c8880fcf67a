"""End to end as in the paper, offline: a web crawl -> extract -> language -> quality -> dedup -> decontaminate ->
tokenize -> train -> evaluate -> export -> generate -> bias study, with the contamination experiment in miniature
(docs/pipeline.md).

    bash scripts/pipeline.sh [OUT_DIR]            # = mtnlg-pipeline [OUT_DIR] (default runs/pipeline)
    mtnlg-pipeline /tmp/p --smoke       # the reduced run of the test suite (tiny model, ~1-2 min)

Builds a web-like corpus of real English prose (the Python standard library's docstrings cut into pages, with
planted exact and near duplicates and planted copies of half of an evaluation set's cloze passages), serves it as
a web crawl (raw/crawl.warc.gz: every document an English page in a site's boilerplate, beside pages in seven other
languages, junk pages, non-HTML payloads and broken records, the truth written beside it), then runs mtnlg-extract,
mtnlg-quality filter --languages en, mtnlg-quality train/score/filter (classifier and Gopher/C4 rules),
mtnlg-dedup, mtnlg-decontaminate (the evaluation set as the task), mtnlg-train-tokenizer,
mtnlg-preprocess (once per corpus), mtnlg fit twice (A: deduplicated, planted text left in;
B: decontaminated; same model, seed and steps), mtnlg-eval on the planted and the control passages for both,
mtnlg-export-hf of B, mtnlg-generate from the export and the bias study of B (mtnlg-eval --task gender-occupation
cooccurrence sentiment: MT-NLG Section 6). Each stage prints one line; every tool's output is in OUT_DIR/logs.
Writes OUT_DIR/report.json, report.md, report.png and bias.png: documents and bytes in and out of every stage,
precision and recall of extraction, the language filter and the quality filter against the planted truth, and
checks that the counts reconcile from stage to stage. Exit status: 0 all checks passed, 1 a check failed, 2 a stage
failed or bad arguments. --no-crawl starts from raw/web.jsonl, as before the crawl stages.
"""

import argparse
import sys
from pathlib import Path

import mtnlg_lightning.corpora.storage as storage
from mtnlg_lightning.corpora.cli_common import int_at_least
from mtnlg_lightning.corpora.commit import destination, visible_files
from mtnlg_lightning.errors import run_main
from mtnlg_lightning.extras import require_extra
from mtnlg_lightning.outputs import kept_until_done


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mtnlg-pipeline", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "out_dir",
        nargs="?",
        default="runs/pipeline",
        help="where every stage writes (default: %(default)s); a URL (s3://bucket/run) is written in a local scratch "
        "folder and committed there when the run ends",
    )
    p.add_argument(
        "--smoke", action="store_true", help="the reduced run: 160 pages, 8+8 passages, tiny model, 20 steps"
    )
    add_count(p, "--steps", 1, "training steps of each run (default: configs/pipeline.yaml's 400)")
    add_count(
        p,
        "--plant-copies",
        1,
        "training documents each planted passage is copied into (default 6; keep it below mtnlg-decontaminate's "
        "--frequent-threshold 10, or decontamination ignores its n-grams)",
    )
    add_count(p, "--eval-passages", 2, "cloze passages, half planted (default 128)")
    p.add_argument(
        "--seed", type=int, default=None, help="seed of the corpus: selection, planting, copies (default 1234)"
    )
    p.add_argument(
        "--no-crawl",
        action="store_true",
        help="start from the raw corpus as JSON lines (raw/web.jsonl), without the crawl stages",
    )
    p.add_argument("--prompt", default="The file is opened", help="the prompt of the generation stage")
    add_count(
        p,
        "--bias-continuations",
        1,
        "continuations sampled per prompt in the bias study of B (default 100, --smoke 4; the paper: 800)",
    )
    p.add_argument(
        "--no-plot", action="store_true", help="skip report.png and bias.png (needs matplotlib: the [plot] extra)"
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace OUT_DIR if it is not empty (the previous one is kept aside until the run succeeds; refused "
        "for ., ~, / and folders holding an input)",
    )
    return p


def add_count(p: argparse.ArgumentParser, flag: str, minimum: int, help: str) -> None:
    """A count that replaces the run's own (the corpus preset's or the config's) when given."""
    p.add_argument(flag, type=int_at_least(minimum), default=None, help=help)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    # imports torch (seconds): `--help` answers without it
    from mtnlg_lightning.demo.pipeline.run import Pipeline, PipelineSettings, prepare_out_dir

    def body() -> int:
        require_extra("hf", "the pipeline's export stage (mtnlg-export-hf)")  # before any stage runs
        require_extra("bias", "the pipeline's bias study (mtnlg-eval --task cooccurrence sentiment)")
        if not args.no_plot:
            require_extra("plot", "report.png (or pass --no-plot)")
        prepare_out_dir(args.out_dir, args.overwrite)
        # a URL: the run writes a scratch folder, committed to the URL when it has finished
        dest = destination(args.out_dir)
        settings = PipelineSettings.for_run(
            dest.local,
            smoke=args.smoke,
            crawl=not args.no_crawl,
            steps=args.steps,
            plant_copies=args.plant_copies,
            eval_passages=args.eval_passages,
            seed=args.seed,
            prompt=args.prompt,
            plot=not args.no_plot,
            bias_continuations=args.bias_continuations,
        )
        committed = f", committed to {args.out_dir} at the end" if dest.remote else ""
        print(
            f"pipeline: writing {settings.out_dir} (tool output in {settings.out_dir / 'logs'}){committed}", flush=True
        )

        with kept_until_done(settings.out_dir):  # a failed run puts the previous OUT_DIR back
            report = Pipeline(settings).run()
        out = Path(report["out_dir"])
        if dest.remote:  # every file, report.json last: it marks the result complete
            names = [n for n in visible_files(dest.local) if n != "report.json"] + ["report.json"]
            dest.publish(names, markers=1, replace=args.overwrite)
            out = args.out_dir
        return outcome(report, storage.join(str(out), "report.md"))

    return run_main("mtnlg-pipeline", body)


def outcome(report: dict, report_md: str) -> int:
    """The run's last line (time, checks, the planted gap, where the report is), each failed check on stderr; the
    exit status: 1 when a check failed."""
    failed = [c for c in report["checks"] if not c["ok"]]
    passed = len(report["checks"]) - len(failed)
    gap = report["experiment"]["planted_gap"]
    print(
        f"pipeline: done in {report['seconds_total']:.0f} s; checks {passed}/{len(report['checks'])} passed; "
        f"planted acc A-B {gap['acc_contaminated_minus_decontaminated']:+.4f}, planted perplexity B/A "
        f"{gap['perplexity_decontaminated_over_contaminated']:.2f}x; report: {report_md}"
    )
    for check in failed:
        print(f"pipeline: check FAILED: {check['name']}: {check['detail']}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
