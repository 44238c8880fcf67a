"""``mtnlg-quality``: heuristic rules, the quality classifier, scoring, filtering."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass

from mtnlg_lightning.corpora.cli_args import URLS_HELP
from mtnlg_lightning.corpora.cli_common import (
    INTERRUPTED,
    add_output_dir_arg,
    add_quiet_arg,
    add_text_key_arg,
    number_where,
    positive_int,
    tool_parser,
)
from mtnlg_lightning.crawl.heuristics import RULES, rule_settings
from mtnlg_lightning.errors import run_main
from mtnlg_lightning.extras import require_extra

from . import quality

PROG = "mtnlg-quality"


def _assignment(value: str) -> tuple[str, float]:
    key, sep, number = value.partition("=")
    try:
        if not sep or "." not in key:
            raise ValueError
        return key.strip(), float(number)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected RULE.PARAM=NUMBER such as word_count.min=100, got {value!r}"
        ) from None


_fraction = number_where("a number in [0, 1]", lambda v: 0.0 <= v <= 1.0)
_positive_float = number_where("a positive number", lambda v: v > 0)


def _languages(value: str) -> tuple[str, ...]:
    codes = tuple(c.strip() for c in value.split(",") if c.strip())
    if not codes:
        raise argparse.ArgumentTypeError(f"expected ISO 639-1 codes separated by commas, e.g. en,de; got {value!r}")
    return codes


def _rules_epilog() -> str:
    lines = ["heuristic rules (RULE: what fails it; thresholds as RULE.PARAM=default):"]
    for r in RULES:
        params = ", ".join(f"{r.name}.{k}={v:g}" for k, v in r.defaults.items()) or "-"
        lines.append(f"  {r.name}: {r.description} [{params}]")
    return "\n".join(lines)


def _add_io(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "inputs", nargs="+", metavar="IN.jsonl", help="JSON lines files, one document per line, " + URLS_HELP
    )
    add_output_dir_arg(
        p, "directory for OUT/<input name> (written atomically; must not be the inputs' directory) and the report"
    )
    add_text_key_arg(p)
    add_quiet_arg(p)


def _add_rules(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--set",
        dest="overrides",
        type=_assignment,
        action="append",
        default=[],
        metavar="RULE.PARAM=VALUE",
        help="change one threshold (repeatable), e.g. --set word_count.min=100; the rules and defaults are listed "
        "below",
    )
    p.add_argument(
        "--disable",
        action="append",
        default=[],
        metavar="RULE",
        help="leave a rule out (repeatable), e.g. --disable stop_words",
    )


DESCRIPTION = (
    "Quality of crawled text. 'annotate' measures the Gopher/C4 heuristic signals of every document and "
    "records the rules it fails (nothing is dropped); 'train' fits GPT-3's quality classifier (logistic "
    "regression on hashed word n-grams) on curated (positive) and raw-crawl (negative) documents; 'score' "
    "adds quality_score; 'filter' keeps documents by score threshold, by GPT-3's Pareto rule, and/or by "
    "the heuristic rules re-applied to the stored signals with any thresholds, without re-scoring."
)


def build_parser() -> argparse.ArgumentParser:
    p = tool_parser(PROG, DESCRIPTION)
    sub = p.add_subparsers(
        dest="command", required=True, metavar="COMMAND", help="annotate | train | score | filter (COMMAND --help)"
    )
    for name, command in COMMANDS.items():
        listing = {"epilog": _rules_epilog(), "formatter_class": argparse.RawDescriptionHelpFormatter}
        shown = listing if command.lists_rules else {}
        command.flags(sub.add_parser(name, help=command.help, description=command.description, **shown))
    return p


def _annotate_flags(a: argparse.ArgumentParser) -> None:
    _add_io(a)
    _add_rules(a)


def _train_flags(t: argparse.ArgumentParser) -> None:
    t.add_argument("--positive", nargs="+", required=True, metavar="POS.jsonl", help="curated (good) documents")
    t.add_argument("--negative", nargs="+", required=True, metavar="NEG.jsonl", help="raw crawl (bad) documents")
    t.add_argument(
        "--model",
        required=True,
        metavar="MODEL.npz",
        help="where to save the model (atomically), a path or a URL",
    )
    add_text_key_arg(t)
    t.add_argument(
        "--holdout",
        type=_fraction,
        default=0.1,
        help="share of each side held out to measure precision/recall before the final fit (0: none)",
    )
    t.add_argument("--features", type=positive_int, default=1 << 18, help="hashed feature dimensions")
    t.add_argument("--max-ngram", type=positive_int, default=2, help="word n-grams of length 1..N as features")
    t.add_argument("--c", type=_positive_float, default=1.0, help="inverse L2 regularisation strength (C)")
    t.add_argument("--seed", type=int, default=0, help="seed of the held-out split and the solver")


def _score_flags(s: argparse.ArgumentParser) -> None:
    _add_io(s)
    s.add_argument(
        "--model", required=True, metavar="MODEL.npz", help="a model saved by 'mtnlg-quality train' (a path or a URL)"
    )
    s.add_argument("--batch", type=positive_int, default=512, help="documents vectorised at a time")


def _filter_flags(f: argparse.ArgumentParser) -> None:
    _add_io(f)
    f.add_argument("--threshold", type=_fraction, default=None, help="keep when quality_score >= this")
    f.add_argument(
        "--pareto",
        type=_positive_float,
        default=None,
        metavar="ALPHA",
        help="GPT-3's rule: keep when np.random.pareto(ALPHA) > 1 - quality_score (GPT-3: ALPHA 9); each "
        "document's draw is seeded by --seed and its text, so it is the same in any file or run",
    )
    f.add_argument("--seed", type=int, default=0, help="seed of the Pareto draws")
    f.add_argument("--heuristics", action="store_true", help="drop documents failing an enabled heuristic rule")
    f.add_argument(
        "--languages",
        type=_languages,
        default=(),
        metavar="en,de,...",
        help="keep only documents whose 'language' (ISO 639-1, from mtnlg-extract) is one of these: the language "
        "filter re-run without re-extracting",
    )
    _add_rules(f)


def _rule_settings(args, parser):
    try:
        return rule_settings(dict(args.overrides), set(args.disable))
    except ValueError as err:
        parser.error(str(err))


@dataclass(frozen=True)
class Command:
    """A subcommand: its line in the tool's help, its own help's description (with the heuristic rules listed below
    it, or not) and the function adding its flags."""

    help: str
    description: str
    lists_rules: bool
    flags: Callable[[argparse.ArgumentParser], None]


COMMANDS = {
    "annotate": Command(
        "add quality_signals and quality_failed (the heuristic rules failed) to every document",
        "Add quality_signals (what the rules measure) and quality_failed (names of the rules the document fails) to "
        "every document; report the documents failing each rule (a document failing several is counted under "
        "each) and failing any (counted once). Nothing is dropped: use 'filter --heuristics'.",
        True,
        _annotate_flags,
    ),
    "train": Command(
        "train the quality classifier on positive and negative documents",
        "Fit logistic regression (scikit-learn, classes balanced) on hashed word 1..N-gram features: --positive "
        "documents (curated text) against --negative ones (raw crawl), as GPT-3. A share of each side is held out "
        "first to report precision and recall, then the model is fit on everything and saved as .npz of plain "
        "arrays (loading it never runs code).",
        False,
        _train_flags,
    ),
    "score": Command(
        "add quality_score (the classifier's P(curated)) to every document",
        "Add quality_score, the classifier's probability that the document is curated-like text, to every document "
        "(all fields kept).",
        False,
        _score_flags,
    ),
    "filter": Command(
        "keep documents by score threshold, Pareto rule and/or heuristic rules",
        "Keep the documents that pass every criterion given. --threshold and --pareto read quality_score (from "
        "'score'); --heuristics re-applies the rules to quality_signals (from 'annotate'; measured on the fly when "
        "absent) with the thresholds of --set/--disable. The report counts the documents dropped by each criterion "
        "(a document failing several is counted under each) and in total (once).",
        True,
        _filter_flags,
    ),
}


def _print_counts(title: str, counts: dict, total: int) -> None:
    print(f"  {title}")
    width = max((len(k) for k in counts), default=0)
    for name, n in counts.items():
        print(f"    {name:<{width}}  {n:>8}  ({n / max(1, total):.1%})")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    settings = None
    if args.command == "annotate" or (args.command == "filter" and args.heuristics):
        settings = _rule_settings(args, parser)
    if args.command == "filter" and not (
        args.threshold is not None or args.pareto is not None or args.heuristics or args.languages
    ):
        parser.error("filter needs at least one of --threshold, --pareto, --heuristics, --languages")

    def body() -> int:
        if args.command in ("train", "score"):  # scikit-learn; annotate and filter need only the core install
            require_extra("crawl", f"{PROG} {args.command}")
        progress = not getattr(args, "quiet", False)
        if args.command == "annotate":
            r = quality.annotate(args.inputs, args.output_dir, settings, args.text_key, progress)
            print(f"{PROG} annotate: {r['documents']} documents in {r['seconds']:.1f} s")
            _print_counts(
                "failing each rule (a document failing several counts under each):",
                r["failing_by_rule"],
                r["documents"],
            )
            print(f"  failing any rule  {r['failing_any_rule']}  passing every rule  {r['passing_every_rule']}")
        elif args.command == "train":
            r = quality.train_model(
                args.positive,
                args.negative,
                args.model,
                args.text_key,
                args.holdout,
                args.features,
                args.max_ngram,
                args.c,
                args.seed,
            )
            print(
                f"{PROG} train: {r['positives']} positive, {r['negatives']} negative documents in {r['seconds']:.1f} s"
            )
            if "holdout" in r:
                h = r["holdout"]
                print(
                    f"  held out {h['documents']}: precision {h['precision']:.3f} recall {h['recall']:.3f} "
                    f"accuracy {h['accuracy']:.3f}"
                )
            print(f"  model      {args.model}")
        elif args.command == "score":
            r = quality.score(args.inputs, args.output_dir, args.model, args.text_key, args.batch, progress)
            print(f"{PROG} score: {r['documents']} documents in {r['seconds']:.1f} s")
            print(f"  scores by tenths 0.0..1.0: {r['score_histogram_tenths']}")
        else:
            r = quality.filter_documents(
                args.inputs,
                args.output_dir,
                args.threshold,
                args.pareto,
                args.seed,
                settings,
                args.text_key,
                progress,
                args.languages,
            )
            print(f"{PROG} filter: kept {r['kept']} of {r['documents']} documents, dropped {r['dropped']}")
            _print_counts("dropped by (a document failing several counts under each):", r["dropped_by"], r["documents"])
        if args.command != "train":
            print(f"  outputs    {args.output_dir}/ (one file per input, quality_{args.command}_report.json)")
        return 0

    return run_main(PROG, body, INTERRUPTED)


if __name__ == "__main__":
    sys.exit(main())
