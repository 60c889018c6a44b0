"""The errors every layer raises and the CLI turns into one ``error:`` line and an exit code."""

from __future__ import annotations


class SpecdecError(Exception):
    """A user-facing error: the CLI prints the message and exits with ``exit_code``."""

    exit_code = 1


class UsageError(SpecdecError):
    """A bad option value or combination: exit code 2, as for any usage error."""

    exit_code = 2
