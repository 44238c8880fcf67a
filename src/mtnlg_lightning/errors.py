"""User-facing errors: raised for bad configuration or bad input, printed as one line by the CLIs."""

from __future__ import annotations

import sys
from collections.abc import Callable


class MTNLGError(ValueError):
    """A problem the user can fix (config, layout, data files). The CLI prints only the message."""


class InputError(Exception):
    """Bad user input to a data tool (missing file, invalid JSON, missing key, empty input).

    The CLIs print ``str(err)`` as a single line on stderr and exit with status 2.
    """


def one_line(error: Exception) -> str:
    """The first line of an error's message (some wrapped library messages run over several lines)."""
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


def exit_status(prog: str, run: Callable[[], object]) -> int:
    """A command's exit status: 0 when `run()` returns; 2, with `PROG: error: <one line>` on stderr, when it
    raises an `MTNLGError` (anything else is a bug and keeps its traceback)."""
    try:
        run()
    except MTNLGError as error:
        print(f"{prog}: error: {one_line(error)}", file=sys.stderr)
        return 2
    return 0
