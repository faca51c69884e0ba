"""Chunk transactions of every rule in one process: a crash inside the update (a hook that
raises leaves memory as a kill would), then a replacement updater — a new `ChunkStep`, so
nothing derived survives — repairs and finishes: bit-identical to the uninterrupted update.
For Muon the crash points cover both passes, the second after its derived buffer (the
orthogonalized directions) was computed and partly applied."""

from __future__ import annotations

import pytest
import torch

from unbroken.train import Phase
from unbroken.update.layout import RetainedLayout
from unbroken.update.marker import Stage
from unbroken.update.rmu import ResumableUpdater, state_from_regions

from ._rig import PROT, built, fake_grads


class Crash(Exception):
    pass


def _rig(optimizer: str, regions: dict | None):
    holder: dict = {}

    def allocate(layout, geometry, device):
        fresh = not holder.get("reuse")
        if fresh:
            specs = RetainedLayout.of(geometry, PROT).regions()
            holder["regions"] = {s.name: torch.zeros(s.nbytes, dtype=torch.uint8) for s in specs}
        return state_from_regions(layout, geometry, holder["regions"]), fresh

    if regions is not None:
        holder.update(reuse=True, regions=regions)
    b = built(optimizer, allocate=allocate, weight_decay=0.1)
    upd = ResumableUpdater(b.state, b.geometry, b.step, holder["regions"], PROT, backend="numpy")
    return b, upd, holder["regions"]


def _iteration(b, upd, it: int, hook) -> None:
    fake_grads(b, it)
    upd.protect(it)
    scale = 0.5 if it == 1 else 1.0
    upd.record_sync(it, loss=0.0, grad_norm=0.0, grad_scale=scale, lr=1e-3)
    upd.update(it, lr=1e-3, grad_scale=scale, hook=hook)


def _crash_at(phase: Phase, nth: int):
    seen = {"n": 0}

    def hook(ph, iteration, step, n_steps):
        if ph is phase and iteration == 1:
            if seen["n"] == nth:
                raise Crash
            seen["n"] += 1

    return hook


def _reference(optimizer: str) -> str:
    b, upd, _ = _rig(optimizer, None)
    upd.initialize(done_iter=-1)
    for it in range(3):
        _iteration(b, upd, it, lambda *a: None)
    return b.state.state_hash()


CASES = [
    ("sgd", Phase.UPDATE, 7),
    ("lion", Phase.PARITY, 11),
    ("muon", Phase.UPDATE, 9),  # pass 0
    ("muon", Phase.WRITEBACK, 60),  # pass 1 (after the derived buffer was applied to chunks)
    ("muon", Phase.UPDATE, 80),
]


@pytest.mark.parametrize(("optimizer", "phase", "nth"), CASES)
def test_crash_inside_the_update_resumes_bit_exact(optimizer, phase, nth):
    b, upd, regions = _rig(optimizer, None)
    n_chunks = len(upd.chunks)
    assert upd.transactions == b.step.passes * n_chunks
    assert nth < upd.transactions
    upd.initialize(done_iter=-1)
    _iteration(b, upd, 0, lambda *a: None)
    with pytest.raises(Crash):
        _iteration(b, upd, 1, _crash_at(phase, nth))
    b2, upd2, _ = _rig(optimizer, regions)
    report = upd2.repair({})
    assert report.fixup != "none"
    st = upd2.marker.state
    assert st.stage is Stage.SYNCED and st.iteration == 1
    if optimizer == "muon" and nth >= n_chunks:
        assert upd2._index(st) >= n_chunks  # resumed inside the second pass
    upd2.update(1, lr=st.lr, grad_scale=st.grad_scale, hook=lambda *a: None)
    _iteration(b2, upd2, 2, lambda *a: None)
    assert b2.state.state_hash() == _reference(optimizer)
