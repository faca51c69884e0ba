"""Page-loss injection: real loss of retained pages, for tests and fault campaigns.

`punch_pages` drops the backing of pages with `fallocate(PUNCH_HOLE | KEEP_SIZE)` on the
region's memfd: the contents are gone for every process that maps the region, and reads return
zeros. It stands in for a hardware-poisoned page where the kernel lacks memory-failure support.
Localization (`unbroken.state.localize`) finds the loss through the memory alone, never through
this module. A write to a punched page silently refills it with fresh memory, so inject, then
localize, before anything touches the region ([Note: localize before touching]).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from unbroken.state._syscalls import FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE, fallocate

__all__ = ["punch_pages"]


class _PagedRegion(Protocol):
    fd: int
    nbytes: int
    page_bytes: int


def punch_pages(region: _PagedRegion, pages: Iterable[int]) -> None:
    """Destroy `pages` of `region` (any object with fd, nbytes, page_bytes).

    Args:
        region: e.g. a `RetainedRegion`.
        pages: page indices in [0, nbytes // page_bytes).

    Raises:
        IndexError: a page index out of range.
        OSError: the kernel refused the punch.
    """
    n_pages = region.nbytes // region.page_bytes
    for page in sorted(set(pages)):
        if not 0 <= page < n_pages:
            raise IndexError(f"page {page} outside a region of {n_pages} pages")
        fallocate(
            region.fd,
            FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
            page * region.page_bytes,
            region.page_bytes,
        )
