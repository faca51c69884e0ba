"""Write-backs behind the marker ([Note: write-back behind the marker] in
`unbroken.update.rmu`): on a GPU with parity in host memory the graph updater writes each
transaction's staged parity back on a second stream, so a crash can leave the marker up to two
write-backs ahead of the host parity. Here the host-marked updater (same slots, same `repair`)
is crashed at each marker stage of a transaction, the write-backs the marker allows to be
pending are taken back (their ranges hold the parity from before them, as if the copies never
ran), and a replacement trainer must repair to the uninterrupted run's bits with parity equal to
a fresh encode — also when the staging slots themselves were lost, and when a second crash
follows the repair."""

from __future__ import annotations

import pytest
import torch

from unbroken.train import Phase
from unbroken.update.marker import Stage

from .test_rmu import Crash, Retained, _reference_hashes, _resume, _rig


@pytest.fixture
def retained():
    r = Retained()
    yield r
    r.pool.close()


@pytest.fixture(scope="module")
def reference():
    return _reference_hashes()


class _CrashAtMarker:
    """Hook: the model parity before each transaction of `iteration` (taken at its
    CHUNK_UPDATING, before its write-back), and a crash right after the marker write of
    `stage` at transaction position `p`."""

    def __init__(self, iteration: int, p: int, stage: Stage) -> None:
        self.iteration, self.p, self.stage = iteration, p, stage
        self.k = -1
        self.before: dict[int, torch.Tensor] = {}
        self.upd = None

    def __call__(self, phase, iteration, step, n) -> None:
        if phase is not Phase.MARKER or iteration != self.iteration:
            return
        stage = Stage(step)
        if stage is Stage.CHUNK_UPDATING:
            self.k += 1
            self.before[self.k] = self.upd.model_parity.clone()
        position = self.k + 1 if stage is Stage.SYNCED else self.k
        if stage is self.stage and position == self.p:
            raise Crash(f"{stage.name}({position})")


def _pending(stage: Stage, p: int) -> list[int]:
    """What the note allows to be pending at marker `stage` of position p."""
    first = p - 2 if stage is Stage.SYNCED else p - 1
    last = p if stage is Stage.PARITY_READY else p - 1
    return list(range(first, last + 1))


def _take_back(upd, hook: _CrashAtMarker, pending: list[int]) -> None:
    """The pending write-backs undone: their ranges as before the first of them."""
    c = upd.geometry.chunk_bytes
    old = hook.before[pending[0]]
    for k in pending:
        ref = upd.chunks[k % len(upd.chunks)]
        rows = (ref.group, slice(None), slice(ref.byte_lo, ref.byte_lo + c))
        upd.model_parity[rows].copy_(old[rows])


def _parity_consistent(upd) -> bool:
    before = upd.model_parity.clone()
    for group in upd.groups:
        group.encode()
    return torch.equal(before, upd.model_parity)


def _crash(retained, stage: Stage, p: int):
    tr, upd, _ = _rig(retained, hooks=[hook := _CrashAtMarker(2, p, stage)])
    hook.upd = upd
    upd.initialize(done_iter=-1)
    with pytest.raises(Crash):
        for it in range(4):
            tr.run_iteration(it)
    assert upd.marker.state.stage is stage
    _take_back(upd, hook, _pending(stage, p))
    return upd


@pytest.mark.parametrize(
    "stage", [Stage.SYNCED, Stage.CHUNK_UPDATING, Stage.PARITY_READY], ids=lambda s: s.name
)
def test_write_backs_behind_the_marker_are_redone_to_the_same_bits(reference, retained, stage):
    p = 5
    upd = _crash(retained, stage, p)
    stale = upd.model_parity.clone()
    tr2, upd2, _, nxt = _resume(retained)
    assert not torch.equal(stale, upd2.model_parity)  # the repair wrote the pending ranges
    assert _parity_consistent(upd2)
    for it in range(nxt, 4):
        tr2.run_iteration(it)
    assert tr2.state.state_hash() == reference[3]
    assert _parity_consistent(upd2)


def test_lost_staging_slots_are_refilled_from_a_fresh_encode_and_survive_a_second_crash(
    reference, retained
):
    _crash(retained, Stage.PARITY_READY, 5)
    retained.lose({"scratch": [0]})
    lost = retained.localize_and_remap()
    assert lost == {"scratch": [0]}
    _, first, _ = _rig(retained)
    report = first.repair(lost)  # then killed before it resumes: a second crash
    assert report.fixup.startswith("rolled")
    assert _parity_consistent(first)
    tr2, upd2, _, nxt = _resume(retained)
    assert _parity_consistent(upd2)
    for it in range(nxt, 4):
        tr2.run_iteration(it)
    assert tr2.state.state_hash() == reference[3]
