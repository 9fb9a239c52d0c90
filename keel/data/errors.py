"""The one exception type the data package raises for mistakes a user can fix."""

from __future__ import annotations


class DataError(ValueError):
    """A user-fixable data problem; the message is one line saying what to change (the CLI prints it bare)."""
