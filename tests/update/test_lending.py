"""The lending pool's raw allocator (`unbroken.update._lend_alloc.c`): ranges of memory the
caller owns handed out best-fit, the rest from the fallback, frees coalesced, the ranges fixed
while any byte of them is held. Its range logic runs on host memory here (the fallback routed
to libc's malloc/free); the CUDA pool over it is exercised by the GPU tier
(`tests/gpu/test_lending.py`)."""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import random

import numpy as np
import pytest

from unbroken.native import NativeUnavailableError
from unbroken.update import lending

KIB = 1024


@pytest.fixture
def lib():
    try:
        _, lib = lending.library()
    except NativeUnavailableError as exc:  # pragma: no cover - CI has a compiler
        pytest.fail(f"the lending allocator must build wherever the erasure kernel does: {exc}")
    libc = ctypes.CDLL(None)
    malloc = ctypes.cast(libc.malloc, ctypes.c_void_p).value
    free = ctypes.cast(libc.free, ctypes.c_void_p).value
    lib.ub_lend_set_fallback(malloc, free)
    yield lib
    lending.set_ranges([])
    lib.ub_lend_set_fallback(None, None)


def _free_entries(lib) -> int:
    out = (ctypes.c_size_t * 8)()
    lib.ub_lend_stats(out, 0)
    return int(out[7])


def _arena(n: int) -> tuple[np.ndarray, int]:
    """Host memory of n bytes and its 4 KiB-aligned base (the allocator trims ranges to 512 B)."""
    arena = np.zeros(n + 4096, np.uint8)
    return arena, (arena.ctypes.data + 4095) & ~4095


def _alloc(lib, n: int) -> int:
    p = lib.ub_lend_alloc(n, 0, None)
    assert p, f"allocation of {n} B refused"
    return p


def test_best_fit_in_the_ranges_then_the_fallback(lib):
    arena, base = _arena(4 << 20)
    big, small = (base, 1 << 20), (base + (2 << 20), 64 * KIB)
    lending.set_ranges([big, small])
    assert lending.stats().lent_bytes == (1 << 20) + 64 * KIB

    a = _alloc(lib, 600 * KIB)  # only the big range holds it
    b = _alloc(lib, 32 * KIB)  # best fit: the small range, not the big one's 424 KiB left
    c = _alloc(lib, 2 << 20)  # neither: the fallback
    assert big[0] <= a < big[0] + big[1]
    assert small[0] <= b < small[0] + small[1]
    assert not (arena.ctypes.data <= c < arena.ctypes.data + arena.nbytes)
    st = lending.stats()
    assert (st.lent_in_use, st.fallback_in_use, st.fallback_calls) == (632 * KIB, 2 << 20, 1)

    with pytest.raises(lending.LentMemoryInUse):
        lending.set_ranges([big])  # held bytes pin the ranges

    for p, n in ((a, 600 * KIB), (b, 32 * KIB), (c, 2 << 20)):
        lib.ub_lend_free(p, n, 0, None)
    st = lending.stats()
    assert (st.lent_in_use, st.fallback_in_use, st.lent_peak) == (0, 0, 632 * KIB)
    assert _free_entries(lib) == 2  # coalesced back to the two ranges
    d = _alloc(lib, 1 << 20)
    assert d == big[0]  # the whole big range again
    lib.ub_lend_free(d, 1 << 20, 0, None)


def test_sizes_round_to_512_bytes_and_touching_ranges_never_merge(lib):
    _keep, base = _arena(1 << 20)
    lending.set_ranges([(base, 64 * KIB), (base + 64 * KIB, 64 * KIB)])
    a = _alloc(lib, 1)
    b = _alloc(lib, 1)
    assert b - a == 512
    lib.ub_lend_free(a, 1, 0, None)
    lib.ub_lend_free(b, 1, 0, None)
    c = _alloc(lib, 100 * KIB)  # 128 KiB of touching ranges, but no one segment spans both
    assert not (base <= c < base + 128 * KIB)
    lib.ub_lend_free(c, 100 * KIB, 0, None)
    assert _free_entries(lib) == 2


def test_random_allocations_never_overlap_and_free_back_to_the_ranges(lib):
    _keep, base = _arena(8 << 20)
    ranges = [(base, 3 << 20), (base + (4 << 20), 1 << 20), (base + (6 << 20), 512 * KIB)]
    lending.set_ranges(ranges)
    rng = random.Random(16)
    live: dict[int, int] = {}
    for _ in range(3000):
        if live and rng.random() < 0.45:
            p = rng.choice(list(live))
            lib.ub_lend_free(p, live.pop(p), 0, None)
            continue
        n = rng.choice([512, 4 * KIB, 100 * KIB, 700 * KIB, 2 << 20])
        p = _alloc(lib, n)
        spans = sorted((q, q + ((m + 511) & ~511)) for q, m in (*live.items(), (p, n)))
        assert all(hi <= lo2 for (_, hi), (lo2, _) in itertools.pairwise(spans))
        inside = [lo <= p < lo + size for lo, size in ranges]
        if any(inside):
            lo, size = ranges[inside.index(True)]
            assert p + n <= lo + size, "a lent segment crosses its range's end"
        live[p] = n
    for p, n in live.items():
        lib.ub_lend_free(p, n, 0, None)
    st = lending.stats()
    assert (st.lent_in_use, st.fallback_in_use) == (0, 0)
    assert _free_entries(lib) == len(ranges)
    assert st.lent_peak > 0 and st.fallback_calls > 0


class _Lending:
    """Stands in for the GPU's pool: records which phases ran routed to it."""

    def __init__(self) -> None:
        self.phases = 0
        self.inside = False

    @contextlib.contextmanager
    def compute(self):
        self.phases += 1
        self.inside = True
        try:
            yield
        finally:
            self.inside = False

    @contextlib.contextmanager
    def paused(self):
        was, self.inside = self.inside, False
        try:
            yield
        finally:
            self.inside = was


class _LendingUpdater:
    """A plain updater with a lending pool, as the GPU's stream updater has."""

    def __init__(self, inner, lending) -> None:
        self.inner, self.lending = inner, lending

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("ordered", [False, True])
def test_the_trainer_lends_forward_and_backward_and_nothing_else(ordered):
    """Each micro-batch's forward and backward run inside the pool's compute phase (the GPU
    routes every allocation there); no phase hook runs routed (the one between forward and
    backward is paused: a fault's memory spike outlives the phase), and the gradient reduction,
    the protection and the update run outside it, where the lent buffers are the updater's."""

    from unbroken.config import DataConfig, JobConfig, ModelConfig, TrainConfig
    from unbroken.parallel import DataPlacement
    from unbroken.train import Phase

    from ..foundation.conftest import local_trainer

    cfg = JobConfig(
        model=ModelConfig(preset="tiny"),
        data=DataConfig(tokens_per_microbatch=64, microbatches=3, max_documents=50),
        train=TrainConfig(iterations=2, lr=1e-3),
    )
    lending = _Lending()
    seen: list[tuple[Phase, bool]] = []
    _, tr = local_trainer(
        cfg,
        hooks=[lambda phase, *_: seen.append((phase, lending.inside))],
        wrap_updater=lambda upd: _LendingUpdater(upd, lending),
        placement=DataPlacement.identity(1, 3) if ordered else None,
    )
    assert tr.lending is lending
    for it in range(2):
        tr.run_iteration(it)
    assert lending.phases == 2 * 3
    assert not any(routed for _, routed in seen)
    assert {Phase.FORWARD, Phase.BACKWARD, Phase.PROTECT, Phase.UPDATE} <= {p for p, _ in seen}


def test_nothing_of_a_forward_outlives_it_on_the_model():
    """A tensor a forward leaves on a module (the MoE layers' load-balancing loss did) would sit
    in lent memory on a GPU when the update begins (`reclaim` refuses it): after forward and
    backward, no module attribute holds a tensor it did not hold before."""
    import torch

    from unbroken.config import DataConfig, JobConfig, ModelConfig, TrainConfig
    from unbroken.engine.replica import build_training

    cfg = JobConfig(
        model=ModelConfig(preset="tiny", moe_experts=4, moe_top_k=2),
        data=DataConfig(tokens_per_microbatch=64, microbatches=1, max_documents=50),
        train=TrainConfig(iterations=1),
    )
    built = build_training(cfg, n_shards=1, device=torch.device("cpu"))

    def tensors():
        return {
            (name, key): id(value)
            for name, mod in built.model.named_modules()
            for key, value in vars(mod).items()
            if isinstance(value, torch.Tensor)
        }

    before = tensors()
    mb = built.source.iteration(0, 0)[0]
    built.loss_fn(built.model, mb, torch.device("cpu")).backward()
    assert tensors() == before


def test_bad_sizes_are_refused_and_many_small_segments_spill_to_the_fallback(lib):
    _keep, base = _arena(8 << 20)
    lending.set_ranges([(base, 4 << 20), (base + (4 << 20), 4 << 20)])
    assert lib.ub_lend_alloc(0, 0, None) is None
    assert lib.ub_lend_alloc(-1, 0, None) is None
    # Every free may add a free-list entry: past 4096 - 64 live lent segments new ones spill to
    # the fallback, so freeing every other one (the worst case for the list) always fits.
    ptrs = [_alloc(lib, 512) for _ in range(4200)]
    lent = [p for p in ptrs if base <= p < base + (8 << 20)]
    assert len(lent) == 4096 - 64
    for p in ptrs[::2] + ptrs[1::2]:
        lib.ub_lend_free(p, 512, 0, None)
    st = lending.stats()
    assert (st.lent_in_use, st.fallback_in_use) == (0, 0)
    assert _free_entries(lib) == 2
    with pytest.raises(ValueError, match="overlap"):
        lending.set_ranges([(base, 4 << 20), (base + (2 << 20), 4 << 20)])


def test_a_freed_range_start_never_merges_with_the_next_range(lib):
    _keep, base = _arena(1 << 20)
    lending.set_ranges([(base, 64 * KIB), (base + 64 * KIB, 64 * KIB)])
    a = _alloc(lib, 64 * KIB)  # the whole first range (best fit: the first of two equal)
    assert a == base
    lib.ub_lend_free(a, 64 * KIB, 0, None)  # touches the second range's free interval
    assert _free_entries(lib) == 2
