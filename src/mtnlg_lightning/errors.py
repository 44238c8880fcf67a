"""User-facing errors: raised for bad configuration or bad input, printed as one line by the CLIs."""


class MTNLGError(ValueError):
    """A problem the user can fix (config, layout, data files). The CLI prints only the message."""
