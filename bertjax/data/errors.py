"""The data layer's one user-facing error (an entry point prints it as one `error:` line)."""

from bertjax.errors import UserError


class DataError(UserError, ValueError):
    """Input data that cannot be used, with a message saying what to change."""
