"""User-facing errors: raised for bad configuration or bad input, printed as one line by the CLIs."""


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
