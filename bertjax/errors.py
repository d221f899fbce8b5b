"""The base of bertjax's user-facing errors. Every error that a user can act on (a setting, a
file, a host, a checkpoint) is a `UserError` whose message is one line naming the field or
file and what to do; each entry point catches `UserError` (and `OSError`) and prints it as its
one `error:` line, so a new error class needs no entry point changed."""


class UserError(Exception):
    """An error whose message is one line saying what to change or do."""


class ConfigError(UserError, ValueError):
    """A config that cannot run (a field out of range or not one of its choices) or cannot run
    on these devices (mesh, batch sizes, lengths)."""
