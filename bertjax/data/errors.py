"""The data layer's one user-facing error (an entry point prints it as one `error:` line)."""


class DataError(ValueError):
    """Input data that cannot be used, with a message saying what to change."""
