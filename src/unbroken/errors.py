"""Errors a user can cause.

A `UserError` carries one line that names what to fix (the key, the file, the flag). The CLI
prints it and exits 2, with no traceback unless `--debug`. Internal failures are never wrapped
into `UserError`: they are bugs and keep their traceback.
"""

__all__ = ["UserError"]


class UserError(Exception):
    """A problem in the user's input (config, CLI flags, data paths) with a one-line fix."""
