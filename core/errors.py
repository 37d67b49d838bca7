"""Errors the user can fix; the CLI prints them as one line and exits with status 2."""


class UsageError(Exception):
    pass
