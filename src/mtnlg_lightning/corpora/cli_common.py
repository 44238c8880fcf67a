"""Shared CLI plumbing of the data tools: their parser, flags and checks (errors end through `errors.run_main`)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from mtnlg_lightning.corpora.cli_args import OUTPUT_URL_HELP
from mtnlg_lightning.corpora.engine import available_cores
from mtnlg_lightning.errors import EXIT_BAD_INPUT, run_main
from mtnlg_lightning.extras import install_hint, missing_modules

# What a curation tool keeps when interrupted (its stages are resumable).
INTERRUPTED = "interrupted; finished stages are kept, re-run the same command to resume"


def int_at_least(minimum: int):
    """An argparse `type` accepting integers >= minimum, with a message naming the bound."""
    wording = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"

    def parse(value: str) -> int:
        try:
            v = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {wording}, got {value!r}") from None
        if v < minimum:
            raise argparse.ArgumentTypeError(f"expected {wording}, got {value!r}")
        return v

    return parse


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)


def number_where(wording: str, accepted: Callable[[float], bool]):
    """An argparse `type` accepting the numbers `accepted` says yes to; otherwise "expected <wording>, got ..."."""

    def parse(value: str) -> float:
        try:
            v = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {wording}, got {value!r}") from None
        if not accepted(v):
            raise argparse.ArgumentTypeError(f"expected {wording}, got {value!r}")
        return v

    return parse


class HelpFormatter:
    """argparse formatter factory that appends '(default: X)' only for meaningful defaults."""

    def __new__(cls, *args, **kwargs):
        class _Formatter(argparse.HelpFormatter):
            def _get_help_string(self, action):
                h = action.help or ""
                if (
                    action.default not in (None, False, argparse.SUPPRESS)
                    and "%(default)" not in h
                    and action.option_strings
                ):
                    h += " (default: %(default)s)"
                return h

        return _Formatter(*args, **kwargs)


def tool_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """The parser every data tool starts from: its name, what it does, and defaults shown where they mean something."""
    return argparse.ArgumentParser(prog=prog, description=description, formatter_class=HelpFormatter)


def add_output_dir_arg(p, help: str) -> None:
    """-o/--output-dir OUT, required: the folder (or URL prefix) a data tool writes its outputs and report into."""
    p.add_argument("--output-dir", "-o", required=True, metavar="OUT", help=f"{help}; {OUTPUT_URL_HELP}")


def add_text_key_arg(p) -> None:
    """--text-key: the JSON key holding each record's text, the same for every data tool."""
    p.add_argument("--text-key", default="text", help="JSON key holding the document text")


def add_quiet_arg(p) -> None:
    """-q/--quiet: no progress bars (the summary at the end is still printed)."""
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bars")


def add_engine_args(p, what: str) -> None:
    """--workers / --engine / --ray-address, the same for every curation CLI."""
    p.add_argument(
        "--workers",
        type=positive_int,
        default=available_cores(),
        help=f"worker processes of the local engine for {what} (default: this machine's cores, here %(default)s)",
    )
    p.add_argument(
        "--engine",
        choices=["local", "ray"],
        default="local",
        help="'local': this machine, --workers processes; 'ray': every stage as Ray tasks on a cluster (inputs and "
        "the output on storage all nodes see: a shared file system, or URLs of an object store, where each worker "
        "keeps its own copy of the run's work files); outputs are byte-identical either way",
    )
    p.add_argument(
        "--ray-address",
        default=None,
        metavar="HOST:PORT",
        help="Ray cluster to join with --engine ray (default: $RAY_ADDRESS, else a local Ray started for the run)",
    )


def add_shard_arg(p, default_mb: int, what: str) -> None:
    """--shard-mb: how much of an input one task processes (and a resumed run skips when finished); `what` names
    the shard and the task."""
    p.add_argument(
        "--shard-mb",
        type=positive_int,
        default=default_mb,
        help=f"largest {what} processes and a resumed run skips when finished; small inputs get smaller shards "
        "(>= 1 MB), about 4 per CPU",
    )


def run_job(prog: str, job: Callable[[], dict], summary: Callable[[dict], str], outputs: Callable[[dict], str]) -> int:
    """A data tool's run under `errors.run_main`: the job, then its summary and a line naming its outputs."""

    def body() -> int:
        report = job()
        print(summary(report))
        if report.get("resumed_stages"):  # a resumable job's: the stages a killed run had finished
            print("  resumed    " + ", ".join(report["resumed_stages"]))
        print(f"  outputs    {outputs(report)}")
        return 0

    return run_main(prog, body, INTERRUPTED)


def check_engine_args(args, parser) -> None:
    if args.ray_address and args.engine != "ray":
        parser.error("--ray-address is for --engine ray")
    if args.engine == "ray":  # before any input is read: one line naming the extra
        if missing_modules("ray"):
            print(f"{parser.prog}: error: --engine ray needs Ray: {install_hint('ray')}", file=sys.stderr)
            raise SystemExit(EXIT_BAD_INPUT)
