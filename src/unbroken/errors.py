"""Errors a user can cause.

A `UserError` carries one line that names what to fix (the key, the file, the flag). The CLI
prints it and exits 2, with no traceback unless `--debug`. Internal failures are never wrapped
into `UserError`: they are bugs and keep their traceback.
"""

__all__ = ["JobFailed", "UserError"]


class UserError(Exception):
    """A problem in the user's input (config, CLI flags, data paths) with a one-line fix."""


class JobFailed(Exception):
    """A job that started but could not finish, with a one-line reason (e.g. every rank failed
    at start-up with the same error, and where its traceback is). The CLI prints it and exits
    1, with no traceback of its own."""
