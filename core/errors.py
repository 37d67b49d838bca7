"""Errors the commands print as one line: what the user can fix in the command line (exit 2), and what the run
could not do (exit 1)."""


class UsageError(Exception):
    """A bad flag, file or model: exit status 2."""


class RunFailure(Exception):
    """The run could not finish (the disk filled up, the device ran out of memory): exit status 1."""
