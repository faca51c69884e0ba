"""The Resilient Memory Pool's bookkeeping: named regions, owned for the pool's lifetime.

A `RetainedPool` lives inside the state-manager process (`unbroken.state.manager`), holds the
fds of named regions and answers allocate / attach / list / localize / remap / discard / free.
A region is host memory (one memfd) or, when allocated with a `device`, GPU memory: one CUDA
virtual-memory allocation per page, held by its handle (`unbroken.state.cuda_vmm`) and exported
as POSIX fds only in batches a trainer asks for (`export`), which trainers map side by side into
one virtual range. It owns the memfds and handles, so region contents survive any trainer's
death; they die with the pool's process. A GPU region needs no file descriptor per page: the
pool keeps exported fds for reuse only up to a budget (half the open-file limit; a replacement
trainer's attach then skips the export), so one manager can retain a whole GPU's memory under
the H200 machine's 20,000-fd limit.

A lost GPU page is a page whose physical allocation is gone — the pool holds no allocation for
it (`discard` is how a failure of the page is injected: the pool drops its reference, the
trainer its own, and the driver frees the memory). Localization reports those pages, as the
memfd's holes for host regions; remap creates new allocations for them (exported like any page).

It never reads or writes page contents: it creates, truncates, seeks holes, punches and
fallocates, and (remap, poison scan) asks the kernel to populate page tables. See
[Note: localize before touching] in `unbroken.state.localize`.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import re
import resource
import time
from dataclasses import dataclass, field
from typing import Any

from unbroken.state._syscalls import (
    FALLOC_FL_KEEP_SIZE,
    FALLOC_FL_PUNCH_HOLE,
    MADV_POPULATE_WRITE,
    fallocate,
    madvise_range,
    memory_failure_supported,
)
from unbroken.state._wire import FDS_PER_MESSAGE
from unbroken.state.localize import hole_pages, page_runs, poisoned_pages

__all__ = ["MAX_REGION_BYTES", "PoolError", "Region", "RetainedPool", "default_fd_budget"]

#: Refuse single regions above this size (16 TiB): a typo, not a model.
MAX_REGION_BYTES = 1 << 44
# Pages one `export` request may ask for: one SCM_RIGHTS message's worth (`_wire`).
MAX_EXPORT = FDS_PER_MESSAGE
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,128}")


class PoolError(Exception):
    """A request the pool refuses (the message names the region and the reason)."""


@dataclass(slots=True)
class Region:
    """One named retained allocation.

    Attributes:
        name: stable name trainers use to find it again ("model", "grad_parity", ...).
        fd: the memfd, owned by the pool (host regions; -1 for GPU regions).
        nbytes: size in bytes, a multiple of `page_bytes`.
        page_bytes: unit of failure localization and remap (a multiple of the OS page size).
        protected: whether the contents are covered by parity (reusable state is not).
        device: CUDA device ordinal of a GPU region; None for host memory.
        serial: this pool's creation number, so a client can tell a re-created region from
            the one it already maps.
        page_handles: GPU regions: the allocation handle of each page, None where it was lost.
        remaps: GPU regions: how many times lost pages were given new allocations. A client
            that mapped the region before (a shadow's premapping) holds the old allocation of
            a remapped page: it maps again unless this number is the one it mapped at.
    """

    name: str
    fd: int
    nbytes: int
    page_bytes: int
    protected: bool
    device: int | None = None
    serial: int = 0
    page_handles: list[Any] | None = None
    remaps: int = 0
    cached_fds: dict[int, int] = field(default_factory=dict)
    """GPU regions: exported fds kept for reuse, by page (within the pool's fd budget)."""

    def describe(self) -> dict[str, object]:
        """The JSON description sent to clients (GPU regions: with the pages they lack)."""
        info: dict[str, object] = {
            "name": self.name,
            "nbytes": self.nbytes,
            "page_bytes": self.page_bytes,
            "protected": self.protected,
            "device": self.device,
            "serial": self.serial,
        }
        if self.page_handles is not None:
            info["missing"] = self.missing_pages()
            info["remaps"] = self.remaps
        return info

    def fds(self) -> list[int]:
        """The fds sent with the region: its memfd (host); none for a GPU region, whose pages
        a client fetches in batches with `RetainedPool.export`."""
        return [self.fd] if self.page_handles is None else []

    def missing_pages(self) -> list[int]:
        """GPU regions: pages without an allocation (lost); host regions: []."""
        if self.page_handles is None:
            return []
        return [p for p, handle in enumerate(self.page_handles) if handle is None]


class RetainedPool:
    """Named memfd regions of one rank.

    Args:
        label: prefix of the memfd names (shows in /proc/PID/fd and /proc/PID/maps).
        detect_poison: run the madvise poison scan; None probes the kernel once.
    """

    def __init__(
        self,
        label: str = "unbroken",
        detect_poison: bool | None = None,
        fd_budget: int | None = None,
    ) -> None:
        self.label = label
        self.detect_poison = memory_failure_supported() if detect_poison is None else detect_poison
        self._regions: dict[str, Region] = {}
        self._serial = 0
        self.fd_budget = default_fd_budget() if fd_budget is None else fd_budget
        """Exported GPU-page fds the pool may keep for reuse (`export`)."""
        self._cached = 0

    def allocate(
        self,
        name: str,
        nbytes: int,
        page_bytes: int,
        protected: bool,
        device: int | None = None,
        replace: bool = False,
    ) -> tuple[Region, bool]:
        """Create region `name`, or reuse it when it exists with the same geometry.

        Args:
            name: region name.
            nbytes: requested size; rounded up to a multiple of `page_bytes`.
            page_bytes: page size, a positive multiple of the OS page size.
            protected: whether parity covers the contents.
            device: a CUDA device ordinal for GPU memory; None (default) for host memory.
            replace: when `name` exists with another geometry, free it and make it anew
                (a trainer that restarts under another plan) instead of refusing.

        Returns:
            (region, fresh): fresh is True when the contents are new (host: zeros, every page
            backed; GPU: undefined until the trainer writes them), False when they were
            retained from an earlier trainer.

        Raises:
            PoolError: bad arguments, `name` exists with a different geometry (and `replace`
                is False), or GPU memory
                could not be created (no driver, out of memory, page size off the granularity).
        """
        size, page_bytes, device = _check_allocation(
            name, nbytes, page_bytes, protected, device, replace
        )
        old = self._regions.get(name)
        if old is not None:
            have = (old.nbytes, old.page_bytes, old.protected, old.device)
            if have == (size, page_bytes, protected, device):
                return old, False
            if not replace:
                raise PoolError(
                    f"region {name!r} exists as nbytes={old.nbytes} page_bytes={old.page_bytes} "
                    f"protected={old.protected} device={old.device}; free it before allocating "
                    f"it as nbytes={size} page_bytes={page_bytes} protected={protected} "
                    f"device={device}"
                )
            self.free(name)
        handles = None
        if device is not None:
            handles = self._create_device(name, size // page_bytes, page_bytes, device)
        fd = self._create_host(name, size) if device is None else -1
        self._serial += 1
        region = Region(name, fd, size, page_bytes, protected, device, self._serial, handles)
        self._regions[name] = region
        return region, True

    def _create_host(self, name: str, size: int) -> int:
        fd = os.memfd_create(f"{self.label}:{name}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            # Back every page now (zeros): a fresh region has no holes, so a trainer killed
            # between allocating a region and writing it leaves a region that reads as never
            # written, not one whose pages localization would report lost.
            _populate_for_write(fd, 0, size)
        except OSError:
            os.close(fd)
            raise
        return fd

    @staticmethod
    def _create_device(name: str, n_pages: int, page_bytes: int, device: int) -> list[Any]:
        from unbroken.state import cuda_vmm

        handles: list[Any] = []
        try:
            gran = cuda_vmm.granularity(device)
            if page_bytes % gran:
                raise PoolError(
                    f"region {name!r}: page_bytes={page_bytes} is not a multiple of device "
                    f"{device}'s allocation granularity {gran}"
                )
            for _ in range(n_pages):
                handles.append(cuda_vmm.create_allocation(page_bytes, device))
            return handles
        except (cuda_vmm.CudaVmmError, PoolError) as exc:
            for handle in handles:
                cuda_vmm.release(handle)
            if isinstance(exc, PoolError):
                raise
            raise PoolError(f"region {name!r} on cuda:{device}: {exc}") from exc

    def get(self, name: object) -> Region:
        """The region called `name`.

        Raises:
            PoolError: no such region.
        """
        if not isinstance(name, str) or name not in self._regions:
            raise PoolError(f"no region named {name!r} (have {sorted(self._regions)})")
        return self._regions[name]

    def regions(self) -> list[Region]:
        """All regions, in allocation order."""
        return list(self._regions.values())

    def localize(self, names: list[str] | None = None) -> tuple[dict[str, list[int]], float]:
        """Find the missing pages of each region (holes, then poison where supported).

        Returns:
            ({name: [page, ...]}, elapsed milliseconds).
        """
        targets = self.regions() if names is None else [self.get(n) for n in names]
        start = time.perf_counter()
        lost: dict[str, list[int]] = {}
        for region in targets:
            if region.page_handles is not None:
                lost[region.name] = region.missing_pages()
                continue
            pages = hole_pages(region.fd, region.nbytes, region.page_bytes)
            if self.detect_poison:
                poisoned = poisoned_pages(region.fd, region.nbytes, region.page_bytes, pages)
                pages = sorted(set(pages) | set(poisoned))
            lost[region.name] = pages
        return lost, (time.perf_counter() - start) * 1e3

    def discard(self, name: str, pages: list[int]) -> None:
        """GPU regions: drop the pool's allocation of `pages` — the memory is gone once no
        trainer maps it (how a page failure is injected on GPU; see the module docstring).

        Raises:
            PoolError: unknown region, a host region, or a page index out of range.
        """
        from unbroken.state import cuda_vmm

        region = self.get(name)
        if region.page_handles is None:
            raise PoolError(f"region {name!r} is host memory; discard covers GPU regions only")
        for p in self._check_pages(region, pages):
            handle, region.page_handles[p] = region.page_handles[p], None
            self._drop_cached(region, [p])  # a kept fd would keep the memory alive
            if handle is not None:
                cuda_vmm.release(handle)

    def remap_device(self, name: str, pages: list[int]) -> float:
        """GPU regions: new allocations for lost `pages` (contents undefined; the trainer
        exports and maps them, then rebuilds them from parity). Returns elapsed ms.

        Raises:
            PoolError: a host region, a page out of range, or a page that is not lost (its
                allocation is mapped by trainers; replacing it under them is not supported).
        """
        region = self.get(name)
        if region.page_handles is None or region.device is None:
            raise PoolError(f"region {name!r} is host memory: use remap")
        start = time.perf_counter()
        wanted = sorted(set(self._check_pages(region, pages)))
        present = [p for p in wanted if region.page_handles[p] is not None]
        if present:
            raise PoolError(f"pages {present} of {name!r} are not lost; only lost pages remap")
        for p in wanted:
            (region.page_handles[p],) = self._create_device(
                name, 1, region.page_bytes, region.device
            )
        region.remaps += 1
        return (time.perf_counter() - start) * 1e3

    def export(self, name: str, pages: list[int]) -> tuple[list[int], list[int]]:
        """GPU regions: an fd for each of `pages`' allocations, in the order given, to send.

        A page's first export keeps its fd while the pool holds fewer than `fd_budget` of
        them, and later exports (the attach of a replacement trainer, on the recovery's
        critical path) send the kept one: exporting costs ~35 us a page on the H200. Past the
        budget an fd is made for this reply only. At most `MAX_EXPORT` pages per call, so the
        fds in flight stay bounded whatever the region's size.

        Returns:
            (fds, transient): the fds in page order, and those of them the caller closes
            once sent (the rest stay the pool's).

        Raises:
            PoolError: a host region, too many or out-of-range pages, a lost page, or the
                driver refused (every fd made for this call is closed).
        """
        from unbroken.state import cuda_vmm

        region = self.get(name)
        if region.page_handles is None:
            raise PoolError(f"region {name!r} is host memory: its memfd comes with attach")
        wanted = self._check_pages(region, pages)
        if len(wanted) > MAX_EXPORT:
            raise PoolError(f"export of {len(wanted)} pages: at most {MAX_EXPORT} per request")
        lost = [p for p in wanted if region.page_handles[p] is None]
        if lost:
            raise PoolError(f"pages {lost} of {name!r} are lost: remap them first")
        fds: list[int] = []
        transient: list[int] = []
        try:
            for p in wanted:
                fd = region.cached_fds.get(p)
                if fd is None:
                    fd = cuda_vmm.export_fd(region.page_handles[p])
                    if self._cached < self.fd_budget:
                        region.cached_fds[p] = fd
                        self._cached += 1
                    else:
                        transient.append(fd)
                fds.append(fd)
        except cuda_vmm.CudaVmmError as exc:
            for fd in transient:
                os.close(fd)
            raise PoolError(f"region {name!r}: {exc}") from exc
        return fds, transient

    def _drop_cached(self, region: Region, pages: list[int]) -> None:
        for p in pages:
            fd = region.cached_fds.pop(p, None)
            if fd is not None:
                os.close(fd)
                self._cached -= 1

    @staticmethod
    def _check_pages(region: Region, pages: object) -> list[int]:
        n_pages = region.nbytes // region.page_bytes
        if not isinstance(pages, list) or not all(
            isinstance(p, int) and not isinstance(p, bool) and 0 <= p < n_pages for p in pages
        ):
            raise PoolError(f"pages of {region.name!r} must be a list of ints in [0, {n_pages})")
        return pages

    def remap(self, name: str, pages: list[int]) -> float:
        """Back `pages` of region `name` with healthy, zeroed, present memory.

        Drops whatever backs each page (punch: also releases a poisoned page from the page
        cache), allocates new pages (fallocate mode 0) and populates them for write through a
        short-lived mapping so they stop reading as holes. Contents are not restored; the
        trainer rebuilds them from parity.

        Returns:
            Elapsed milliseconds.

        Raises:
            PoolError: unknown region or a page index out of range.
        """
        region = self.get(name)
        if region.device is not None:
            raise PoolError(f"region {name!r} is GPU memory: use remap_device")
        self._check_pages(region, pages)
        start = time.perf_counter()
        for first, count in page_runs(sorted(set(pages))):
            offset, length = first * region.page_bytes, count * region.page_bytes
            fallocate(region.fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, length)
            fallocate(region.fd, 0, offset, length)
            _populate_for_write(region.fd, offset, length)
        return (time.perf_counter() - start) * 1e3

    def free(self, name: str) -> None:
        """Forget region `name`: close its memfd or release its allocations (the memory goes
        once no client maps it)."""
        region = self.get(name)
        del self._regions[name]
        for fd in region.fds():
            os.close(fd)
        self._drop_cached(region, list(region.cached_fds))
        if region.page_handles is not None:
            from unbroken.state import cuda_vmm

            for handle in region.page_handles:
                if handle is not None:
                    cuda_vmm.release(handle)

    def close(self) -> None:
        """Free every region."""
        for name in list(self._regions):
            self.free(name)


def _populate_for_write(fd: int, offset: int, length: int) -> None:
    """Fault pages in for write via the kernel (zero-filled); no byte is read or written here."""
    mapping = mmap.mmap(
        fd, length, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, offset=offset
    )
    anchor = ctypes.c_char.from_buffer(mapping)
    try:
        err = madvise_range(ctypes.addressof(anchor), length, MADV_POPULATE_WRITE)
        if err:
            raise OSError(err, f"madvise(MADV_POPULATE_WRITE): {os.strerror(err)}")
    finally:
        del anchor
        mapping.close()


def _check_name(name: object) -> None:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise PoolError(f"region name {name!r} must be 1-128 chars of [A-Za-z0-9_.-]")


def _check_int(key: str, value: object, low: int, high: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise PoolError(f"{key}={value!r} must be an int in [{low}, {high}]")
    return value


def default_fd_budget() -> int:
    """Kept GPU-page fds: half the open-file limit (10,000 of the H200 machine's 20,000, about
    21 GB of 2 MiB pages), the rest left for sockets, memfds and the driver."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(0, soft // 2) if soft != resource.RLIM_INFINITY else 1 << 16


def _check_allocation(
    name: str, nbytes: int, page_bytes: int, protected: bool, device: int | None, replace: bool
) -> tuple[int, int, int | None]:
    """Validate `RetainedPool.allocate`'s arguments; return (size, page_bytes, device)."""
    _check_name(name)
    page_bytes = _check_int("page_bytes", page_bytes, mmap.PAGESIZE, MAX_REGION_BYTES)
    if page_bytes % mmap.PAGESIZE:
        raise PoolError(f"page_bytes={page_bytes} is not a multiple of {mmap.PAGESIZE}")
    nbytes = _check_int("nbytes", nbytes, 1, MAX_REGION_BYTES)
    if not isinstance(protected, bool):
        raise PoolError(f"protected must be a bool, got {protected!r}")
    if not isinstance(replace, bool):
        raise PoolError(f"replace must be a bool, got {replace!r}")
    if device is not None:
        device = _check_int("device", device, 0, 1023)
    return -(-nbytes // page_bytes) * page_bytes, page_bytes, device
