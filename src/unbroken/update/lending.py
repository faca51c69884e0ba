"""Activation memory lent by the protection buffers (Leto §5.2, "Minimizing memory and transfer
overhead"): between the end of an update and the protection of the next iteration's gradients,
nothing reads the gradient parity, the undo buffer or the scratch slots, so the compute phase's
activations live there.

How: a `torch.cuda.MemPool` whose raw allocator (`_lend_alloc.c`, loaded by torch as a
`CUDAPluggableAllocator`) hands the caching allocator segments inside those retained regions
first — best fit — and beyond them from the driver (cuMemAlloc). While `LendingPool.compute()`
is entered, every allocation on the device, the autograd thread's included, goes to that pool;
outside it nothing does, so the pool's blocks are all free again once the backward's tensors
are released. The pool keeps its segments cached, so the regions are never given back: the
updater writes them in place (its CUDA graph keeps its addresses) while the caching allocator
merely holds free blocks there.

Why the regions survive the trainer: they are retained memory (the state manager's), so a
trainer killed inside an update leaves its undo copy and its scratch slots where `repair` reads
them; a trainer killed in its compute phase leaves activations there, which `repair` never
reads: the marker says IDLE then (the undo and scratch only matter inside an update, the
gradient parity only from GRADS_PROTECTED on, and `repair` reconstructs the gradients only
then), or GRADS_PROTECTED of an iteration computed again after a failure, whose gradients are
zeroed and recomputed whatever `repair` rebuilt.

Safety: `reclaim()` (the updater calls it before it protects the gradients) checks that no
allocation of the pool is still alive; a tensor made in the compute phase and kept past it
inside a lent region would be overwritten by the update, so that raises `LentMemoryInUse`
(naming the blocks) instead. The first compute phase of a process runs unlent: it creates the
process's lasting buffers (cuBLAS workspaces per thread and stream, compiled kernels' state),
which must not land in the pool; the default pool's cache is emptied when the second begins,
so the first phase's activations are not held twice. A process whose shadow warm-up made them
already (`mark_warmed`) lends from its first phase: a promoted trainer's first iteration then
makes no unlent allocations that its second frees again.

Not lent: the CUDA-graph step of the bench's ``graphs`` mode (Inductor's graph trees allocate
from their own private pool), and the hybrid-parallel engine's stages (their compute phase is
the interpreter's). The staging buffers of host parity (two chunks' parity) stay permanent.

Hand-written: torch's pluggable allocators take C functions, and no maintained library hands
out sub-ranges of memory a caller already owns.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from unbroken.native import build_shared

__all__ = ["LendingPool", "LendingStats", "LentMemoryInUse", "library", "mark_warmed"]

_SOURCE = Path(__file__).with_name("_lend_alloc.c")
_STATS = 8
_GUARD = 512
"""Bytes at the start of each lent region never handed out. A region that is itself a block of
torch's caching allocator (the local regions of tests and benches; a job's are the state
manager's mappings) is keyed by its start address there, and a pool segment at the same address
would replace that key: the region's own free then aborts ("invalid device pointer", seen on
the H200)."""
_CURRENT: LendingPool | None = None
"""The process's lending pool (one at a time: the raw allocator's ranges are the library's)."""
_WARMED = False
"""This process's lasting buffers exist already (a shadow's warm-up ran the model's forward and
backward on the device: `unbroken.shadow.warm`), so its first compute phase may lend too."""


def mark_warmed() -> None:
    """Record that this process ran the model's kernels once on the device (its cuBLAS
    workspaces, per thread and stream, are made): a lending pool lends from its first compute
    phase on, with no unlent phase whose driver allocations the next one frees again."""
    global _WARMED
    _WARMED = True


class LentMemoryInUse(RuntimeError):
    """A tensor allocated in the compute phase is still alive inside lent memory when the
    protection buffers are needed back."""


@dataclass(frozen=True, slots=True)
class LendingStats:
    lent_bytes: int
    """Bytes of the lent regions (trimmed to 512-byte alignment)."""
    lent_in_use: int
    """Bytes of them the caching allocator holds now (its segments, free blocks included)."""
    lent_peak: int
    """The most of them it has held since the last `reset_peaks`."""
    fallback_in_use: int
    """Bytes of the pool's segments from the driver (past the lent regions)."""
    fallback_peak: int
    fallback_calls: int
    refused: int
    """Allocations neither the regions nor the driver could serve (the caching allocator then
    reports an out-of-memory)."""


@functools.cache
def library() -> tuple[Path, ctypes.CDLL]:
    """The raw allocator's library (built on first use) and its ctypes handle."""
    path = build_shared(_SOURCE, "lending", who="unbroken.update.lending")
    lib = ctypes.CDLL(str(path))
    lib.ub_lend_set_ranges.restype = ctypes.c_int
    lib.ub_lend_set_ranges.argtypes = [
        ctypes.POINTER(ctypes.c_size_t),
        ctypes.POINTER(ctypes.c_size_t),
        ctypes.c_int,
    ]
    lib.ub_lend_alloc.restype = ctypes.c_void_p
    lib.ub_lend_alloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    lib.ub_lend_free.restype = None
    lib.ub_lend_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    lib.ub_lend_stats.restype = None
    lib.ub_lend_stats.argtypes = [ctypes.POINTER(ctypes.c_size_t), ctypes.c_int]
    lib.ub_lend_set_fallback.restype = None
    lib.ub_lend_set_fallback.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    return path, lib


def set_ranges(ranges: Sequence[tuple[int, int]]) -> None:
    """Lend `ranges` ((address, bytes) pairs) from now on.

    Raises:
        ValueError: two ranges overlap.
        LentMemoryInUse: the allocator still holds bytes of the previous ranges.
    """
    spans = sorted(ranges)
    for (a, n), (b, _) in itertools.pairwise(spans):
        if a + n > b:
            raise ValueError(f"unbroken.update.lending: lent ranges overlap at {b:#x}")
    _, lib = library()
    n = len(ranges)
    los = (ctypes.c_size_t * max(n, 1))(*(a for a, _ in ranges))
    sizes = (ctypes.c_size_t * max(n, 1))(*(b for _, b in ranges))
    if not lib.ub_lend_set_ranges(los, sizes, n):
        raise LentMemoryInUse(
            "unbroken.update.lending: the lent ranges cannot change while the pool holds "
            "segments in them (one lending pool per process; empty its cache first)"
        )


def stats(reset_peaks: bool = False) -> LendingStats:
    """The raw allocator's counters (process-wide)."""
    _, lib = library()
    out = (ctypes.c_size_t * _STATS)()
    lib.ub_lend_stats(out, int(reset_peaks))
    return LendingStats(*(int(x) for x in out[:7]))


class LendingPool:
    """The compute phase's memory pool over lent regions (see the module docstring).

    Args:
        regions: CUDA tensors whose memory is lent (contiguous; the updater's gradient parity,
            undo and scratch regions).
        device: their device.
    """

    def __init__(self, regions: Sequence[torch.Tensor], device: torch.device) -> None:
        self.device = device
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        self.ranges = [
            (t.data_ptr() + _GUARD, t.numel() * t.element_size() - _GUARD) for t in regions
        ]
        path, _ = library()
        global _CURRENT
        if _CURRENT is not None:
            _CURRENT.retire()
        set_ranges(self.ranges)
        self._regions = list(regions)
        """Held while the pool may hand the ranges out (until `retire` frees its segments)."""
        allocator = torch.cuda.memory.CUDAPluggableAllocator(
            str(path), "ub_lend_alloc", "ub_lend_free"
        )
        self._allocator = allocator
        self.pool = torch.cuda.MemPool(allocator.allocator())
        # Never destroyed: torch drops a pool's blocks when its MemPool goes, live ones
        # included, and a later free of such a tensor aborts the process (seen on the H200 at
        # exit). `retire` gives the pool up instead.
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(self.pool))
        self.retired = False
        _CURRENT = self
        self._lending = False
        """Whether compute phases lend yet (not in a process's first; see the docstring)."""
        self._routing = False
        self.phases = 0
        """Compute phases entered (lent or not)."""
        self.lent_phases = 0
        """Compute phases that lent (all but a process's first, unless it was warmed)."""

    @contextlib.contextmanager
    def compute(self) -> Iterator[None]:
        """Route every allocation on the device to the pool (any thread) while entered."""
        self.phases += 1
        if self.retired or (self.phases == 1 and not _WARMED):
            yield
            return
        if not self._lending:
            # The first phase's activations are all released now (its loss too): hand the
            # default pool's cached segments back before the pool takes over.
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            self._lending = True
        self.lent_phases += 1
        self._route(True)
        try:
            yield
        finally:
            self._route(False)

    def _route(self, on: bool) -> None:
        if on:
            torch._C._cuda_beginAllocateToPool(self.index, self.pool.id)
        else:
            torch._C._cuda_endAllocateToPool(self.index, self.pool.id)
            torch._C._cuda_releasePool(self.index, self.pool.id)
        self._routing = on

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Inside `compute()`: allocations in between go to torch's default pool again (the
        phase hooks between forward and backward — a fault injector's memory spike outlives
        the phase, and torch refuses `empty_cache` while a pool is routed to)."""
        if not self._routing:
            yield
            return
        self._route(False)
        try:
            yield
        finally:
            self._route(True)

    def retire(self) -> None:
        """Stop lending for good (a later pool of this process lends other regions): the pool's
        use count drops to zero, so torch frees its cached segments — back to the raw
        allocator's free list — and any still alive when they are released."""
        if self.retired:
            return
        torch.cuda.synchronize(self.device)
        torch._C._cuda_releasePool(self.index, self.pool.id)
        torch.cuda.empty_cache()
        self._lending, self.retired = False, True
        if stats().lent_in_use == 0:
            self._regions = []

    def live_blocks(self) -> list[tuple[int, int]]:
        """(address, bytes) of the pool's allocations still alive inside the lent ranges."""
        out = []
        for seg in self.pool.snapshot():
            addr = seg["address"]
            for block in seg["blocks"]:
                addr = block.get("address", addr)
                if block["state"] != "inactive" and self._lent(addr):
                    out.append((addr, block["size"]))
                addr += block["size"]
        return out

    def _lent(self, addr: int) -> bool:
        return any(lo <= addr < lo + n for lo, n in self.ranges)

    def reclaim(self) -> None:
        """Before the lent memory is written again: no allocation of the pool may be alive in
        it. Cheap when none is (one check of the pool's live set).

        Raises:
            LentMemoryInUse: with the blocks still alive.
        """
        if not self._lending:
            return
        # Blocks freed while another stream still used them count as free to the check below;
        # once the device is idle no stream uses them.
        torch.cuda.synchronize(self.device)
        if torch._C._cuda_checkPoolLiveAllocations(self.index, self.pool.id, set()):
            return
        live = self.live_blocks()
        if live:
            shown = ", ".join(f"{n} B at {a:#x}" for a, n in live[:8])
            raise LentMemoryInUse(
                f"unbroken.update.lending: {len(live)} tensor(s) made in the compute phase are "
                f"still alive in lent memory ({shown}); the update would overwrite them. Keep "
                "nothing from forward/backward past the compute phase, or copy it out "
                "(protection.lend_activations = false turns lending off)"
            )

    def stats(self, reset_peaks: bool = False) -> LendingStats:
        return stats(reset_peaks)
