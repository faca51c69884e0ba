"""The errors of the erasure package: a geometry the code cannot have, and a loss it cannot undo.

`UnrecoverableError` is how recovery learns that retained state must come from a checkpoint; it
is raised before any page is written, so a failed reconstruction never leaves wrong data behind.
"""

from __future__ import annotations

from collections.abc import Iterable

from unbroken.errors import UserError

__all__ = ["GeometryError", "UnrecoverableError"]


class GeometryError(UserError, ValueError):
    """An erasure geometry (page size, page counts) that the code cannot have."""


class UnrecoverableError(RuntimeError):
    """More pages were lost than the code tolerates; nothing was written.

    Attributes:
        group: the name of the protection group (or code) that lost the pages.
        lost: the lost page indices, sorted, in the numbering of the caller.
    """

    def __init__(self, *, group: str, lost: Iterable[int], detail: str = "") -> None:
        self.group = group
        self.lost = tuple(sorted(set(lost)))
        message = f"protection group {group!r} is not recoverable: lost pages {list(self.lost)}"
        if detail:
            message += f" ({detail})"
        super().__init__(message)

    def __reduce__(self):  # keep the keyword-only constructor picklable across processes
        return (_rebuild, (self.group, self.lost, str(self)))


def _rebuild(group: str, lost: tuple[int, ...], message: str) -> UnrecoverableError:
    error = UnrecoverableError(group=group, lost=lost)
    error.args = (message,)
    return error
