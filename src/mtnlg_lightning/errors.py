"""User-facing errors and the one way every console script and tool ends: one line and an exit status.

Every problem a user can fix (configuration, layout, data files, checkpoints, missing extras) is an `MTNLGError`
(subclasses where a caller needs to tell them apart). `run_main` turns it into `PROG: error: <one line>` on stderr
and exit status 2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

EXIT_ERROR = 1  # the machine failed the command (disk full, permission denied): one line, no traceback
EXIT_BAD_INPUT = 2  # an MTNLGError: the user's input or configuration
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT, as shells report it)


class MTNLGError(ValueError):
    """A problem the user can fix (config, layout, data files). The CLI prints only the message."""


class InputError(MTNLGError):
    """Bad input to a data tool (missing file, invalid JSON, missing key, empty input), naming file:line."""


def one_line(error: BaseException) -> str:
    """The first line of an error's message (some wrapped library messages run over several lines)."""
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


def is_rank_zero() -> bool:
    """Rank 0 of the launcher's world (or a plain process): the one that speaks for every rank. torchrun and srun
    set RANK; Lightning's own launcher sets only the local and node ranks of the processes it starts."""
    if "RANK" in os.environ:
        return os.environ["RANK"] == "0"
    return os.environ.get("LOCAL_RANK", "0") == "0" and os.environ.get("NODE_RANK", "0") == "0"


def run_main(prog: str, body: Callable[[], int | None], interrupted: str = "interrupted") -> int:
    """The exit status of a command: `body()`'s (0 when it returns None); 2 for an `MTNLGError`, 1 for an `OSError`
    of the machine (disk full, permission denied), 130 for Ctrl-C (`interrupted` says what is kept), each with one
    line on stderr from rank 0 only (every rank of a layout raises the same error)."""

    def say(message: str) -> None:
        if is_rank_zero():
            print(f"{prog}: {message}", file=sys.stderr)

    try:
        return int(body() or 0)
    except MTNLGError as error:
        say(f"error: {one_line(error)}")
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        say(interrupted)
        return EXIT_INTERRUPTED
    except OSError as error:
        say(f"error: {one_line(error)}")
        return EXIT_ERROR
    except Exception as error:
        cause = bad_input_cause(error)
        if cause is None:
            raise
        say(f"error: {one_line(cause)}")
        return EXIT_BAD_INPUT


def bad_input_cause(error: BaseException) -> MTNLGError | None:
    """The `MTNLGError` a library wrapped into its own exception (jsonargparse builds a data module while it checks a
    config, and reports what its constructor raised as a `ValueError` caused by it), if any."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, MTNLGError):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None
