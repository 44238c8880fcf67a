"""User-facing errors: raised for bad configuration or bad input, printed as one line by the CLIs."""


class MTNLGError(ValueError):
    """A problem the user can fix (config, layout, data files). The CLI prints only the message."""


def one_line(error: Exception) -> str:
    """The first line of an error's message (some wrapped library messages run over several lines)."""
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__
