"""Failure localization: which pages of a retained region are gone, found through the memory.

Two detectors, run in this order for every region (see [Note: localize before touching]):

1. **Holes** (`hole_pages`): `lseek(SEEK_HOLE/SEEK_DATA)` over the memfd. A page whose backing
   was dropped (`fallocate(PUNCH_HOLE)`, which is how `unbroken.state.pageloss` injects real loss
   where the kernel cannot poison pages) is a hole. Costs ≈ 7 ms per GiB and never touches a page.
2. **Poison** (`poisoned_pages`): the real mechanism from Leto §4.2. Coarse ranges of a mapping
   get `madvise(MADV_POPULATE_READ)`; a range containing a hardware-poisoned page fails with
   EHWPOISON and is bisected down to the page. Needs ``CONFIG_MEMORY_FAILURE``; support is
   probed once per process (`unbroken.state._syscalls.memory_failure_supported`). On the CI
   kernel MADV_HWPOISON is EINVAL, so only the hole detector runs there.

[Note: localize before touching]
A hole is refilled (with zeros, silently) as soon as any process writes the page, and populate
advice would refill it too. So holes are scanned first, the poison scan skips pages that are
already known lost, and nobody — manager or trainer — may touch retained pages before
`localize` has run after a failure. A page that was never written is also a hole: trainers must
write every page of a region right after allocating it (``region.tensor.zero_()`` does).

Neither detector reads or writes page contents, and neither consults any injector's records.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
from collections.abc import Callable, Iterable

from unbroken.state._syscalls import EHWPOISON, MADV_POPULATE_READ, madvise_range

__all__ = ["bisect_failed_pages", "hole_pages", "page_runs", "poisoned_pages"]

#: Pages probed by one madvise call before bisection narrows a failing range down.
POISON_SCAN_PAGES = 64


def page_runs(pages: list[int]) -> list[tuple[int, int]]:
    """Consecutive runs of sorted distinct pages as (first, count)."""
    runs: list[tuple[int, int]] = []
    for page in pages:
        if runs and runs[-1][0] + runs[-1][1] == page:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((page, 1))
    return runs


def hole_pages(fd: int, size: int, page_bytes: int) -> list[int]:
    """Indices of pages of `fd` (size `size`) that overlap a hole, in ascending order.

    Args:
        fd: a memfd (or any file whose filesystem reports holes).
        size: the file size in bytes, a multiple of `page_bytes`.
        page_bytes: the page size of the region.

    Returns:
        Every page index p such that some byte of [p*page_bytes, (p+1)*page_bytes) is a hole.
    """
    lost: list[int] = []
    offset = 0
    while offset < size:
        try:
            hole = os.lseek(fd, offset, os.SEEK_HOLE)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # offset at or past the end
                break
            raise
        if hole >= size:
            break
        try:
            data = min(os.lseek(fd, hole, os.SEEK_DATA), size)
        except OSError as exc:
            if exc.errno != errno.ENXIO:  # ENXIO: no data after `hole`
                raise
            data = size
        first = hole // page_bytes
        last = -(-data // page_bytes)  # exclusive, rounded up
        if lost and lost[-1] >= first:
            first = lost[-1] + 1
        lost.extend(range(first, last))
        offset = data
    return lost


def bisect_failed_pages(
    first: int, count: int, range_fails: Callable[[int, int], bool]
) -> list[int]:
    """Pages in [first, first + count) that make `range_fails(start, n)` true, by bisection.

    `range_fails` answers for a whole range at once (one madvise call); a failing range is split
    in halves until single pages remain. Costs O(f log n) probes for f failed pages.
    """
    if count <= 0 or not range_fails(first, count):
        return []
    if count == 1:
        return [first]
    half = count // 2
    return bisect_failed_pages(first, half, range_fails) + bisect_failed_pages(
        first + half, count - half, range_fails
    )


def poisoned_pages(fd: int, size: int, page_bytes: int, skip: Iterable[int] = ()) -> list[int]:
    """Pages of `fd` holding hardware-poisoned memory (madvise scan with bisection).

    Only meaningful where `memory_failure_supported()`; elsewhere nothing can be poisoned and
    the caller should not call this. Pages in `skip` (already known lost, e.g. holes) are never
    probed, because populating them would refill them.

    Returns:
        Indices of poisoned pages, ascending.
    """
    skipped = set(skip)
    n_pages = size // page_bytes
    if n_pages == 0:
        return []
    mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    anchor = ctypes.c_char.from_buffer(mapping)
    base = ctypes.addressof(anchor)

    def range_fails(start: int, n: int) -> bool:
        err = madvise_range(base + start * page_bytes, n * page_bytes, MADV_POPULATE_READ)
        if err not in (0, EHWPOISON):
            raise OSError(err, f"madvise(MADV_POPULATE_READ): {os.strerror(err)}")
        return err == EHWPOISON

    try:
        lost: list[int] = []
        for start, n in _runs_without(skipped, n_pages, POISON_SCAN_PAGES):
            lost.extend(bisect_failed_pages(start, n, range_fails))
        return lost
    finally:
        del anchor
        mapping.close()


def _runs_without(skipped: set[int], n_pages: int, max_run: int) -> list[tuple[int, int]]:
    """Split [0, n_pages) minus `skipped` into (start, count) runs of at most `max_run`."""
    runs: list[tuple[int, int]] = []
    start = None
    for page in range(n_pages + 1):
        if page < n_pages and page not in skipped:
            if start is None:
                start = page
            if page - start + 1 == max_run:
                runs.append((start, max_run))
                start = None
        elif start is not None:
            runs.append((start, page - start))
            start = None
    return runs
