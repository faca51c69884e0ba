"""The stream-ordered resumable updater (issue 16, items 2-3): markers written by the CUDA
stream carry the host writer's bytes, the update computes the plain updater's bits, and a
transaction interrupted anywhere is repaired and resumed to the same bits."""

from __future__ import annotations

import pytest
import torch

from unbroken.engine.replica import build_training
from unbroken.train.phases import Phase
from unbroken.update import PlainUpdater
from unbroken.update.layout import MARKER_PAGE
from unbroken.update.marker import MARKER_BYTES, ProgressMarker, Stage
from unbroken.update.rmu import ResumableUpdater, local_allocator

from ._updater_rig import CFG, LR, PROT, SCALE, cuda
from ._updater_rig import noop as _noop


def _build(protected: bool):
    dev = torch.device("cuda")
    regions: dict[str, torch.Tensor] = {}
    allocate = local_allocator(PROT, regions) if protected else None
    b = build_training(CFG, n_shards=1, device=dev, allocate=allocate)
    return b, regions


def _grads(b, iteration: int) -> None:
    gen = torch.Generator().manual_seed(100 + iteration)
    b.state.grads.copy_(torch.randn(b.state.grads.numel(), generator=gen) * 1e-2)


def _iterate(b, upd, iteration: int, hook=_noop) -> None:
    _grads(b, iteration)
    upd.protect(iteration)
    upd.record_sync(iteration, loss=2.5, grad_norm=1.25, grad_scale=SCALE, lr=LR)
    upd.update(iteration, lr=LR, grad_scale=SCALE, hook=hook)


def _parity_consistent(upd: ResumableUpdater) -> bool:
    for group in upd.groups:
        before = [p.clone() for p in upd.model_parity]
        group.encode()
        if not all(torch.equal(a, b) for a, b in zip(before, upd.model_parity, strict=True)):
            return False
    return True


@pytest.mark.gpu
@cuda
def test_a_marker_written_by_the_stream_has_the_host_writers_bytes_in_all_three_pages():
    from unbroken.update.device_marker import DeviceMarker

    host = torch.zeros(MARKER_BYTES, dtype=torch.uint8)
    pages = torch.zeros((3, MARKER_PAGE), dtype=torch.uint8, pin_memory=True)
    dm = DeviceMarker(pages, torch.device("cuda"))
    writer = ProgressMarker(host)
    fields = [
        dict(stage=Stage.IDLE, iteration=0, done_iter=-1),
        dict(stage=Stage.SYNCED, iteration=7, loss=3.25, grad_norm=0.5, grad_scale=0.9, lr=3e-4),
        dict(stage=Stage.CHUNK_UPDATING, group=123456, chunk=7),
        dict(stage=Stage.IDLE, done_iter=2**40, loss=-1.5e300),
    ]
    for f in fields:
        state = writer.write(**f)
        dm.write(state)
        torch.cuda.synchronize()
        assert torch.equal(pages[0, :MARKER_BYTES], host)
        assert torch.equal(pages[1], pages[0]) and torch.equal(pages[2], pages[0])
        assert ProgressMarker(pages[0, :MARKER_BYTES]).read() == state


@pytest.mark.gpu
@cuda
def test_a_dropped_marker_unregisters_the_host_pages_it_registered():
    """Freed host memory left registered poisons the next allocation at its address."""
    import gc

    from unbroken.update.device_marker import DeviceMarker

    pages = torch.zeros((3, MARKER_PAGE), dtype=torch.uint8)  # pageable: the marker registers it
    dm = DeviceMarker(pages, torch.device("cuda"))
    writer = ProgressMarker(torch.zeros(MARKER_BYTES, dtype=torch.uint8))
    dm.write(writer.write(stage=Stage.IDLE, iteration=0, done_iter=-1))
    assert pages.is_pinned()
    del dm
    gc.collect()
    assert not pages.is_pinned()


def _kinds():
    from unbroken.update.graph import GraphUpdater
    from unbroken.update.stream import StreamUpdater

    return {"stream": StreamUpdater, "unfused": GraphUpdater, "auto": GraphUpdater}


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("kind", ["stream", "unfused", "auto"])
def test_stream_updaters_are_chosen_on_the_gpu_and_compute_the_plain_updaters_bits(kind):
    """The stream updater, and the graph updater (the default for AdamW, with the fused
    transaction or without it) whose one capture serves every fresh update."""
    from unbroken.update.factory import resumable_updater

    plain, _ = _build(protected=False)
    pu = PlainUpdater(plain.state, plain.geometry, plain.step)
    prot, regions = _build(protected=True)
    su = resumable_updater(prot.state, prot.geometry, prot.step, regions, PROT, kind=kind)
    assert type(su) is _kinds()[kind]
    su.initialize(-1)
    for it in range(4):
        _iterate(plain, pu, it)
        _iterate(prot, su, it)
        assert prot.state.state_hash() == plain.state.state_hash(), it
        torch.cuda.synchronize()
        on_disk = ProgressMarker(regions["marker"][:MARKER_BYTES]).read()
        assert on_disk == su.marker.state, it
        assert (on_disk.stage, on_disk.done_iter) == (Stage.IDLE, it)
    assert _parity_consistent(su)
    if kind != "stream":
        assert su.captures == 1
        assert (su.fused is not None) == (kind == "auto")  # the fused transaction by default


class _Crash(Exception):
    pass


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("kind", ["stream", "unfused", "auto"])
@pytest.mark.parametrize("phase", [Phase.UPDATE, Phase.PARITY, Phase.WRITEBACK, Phase.MARKER])
def test_an_update_interrupted_at_any_stage_is_repaired_and_resumed_to_the_same_bits(phase, kind):
    """The host stops mid-transaction with its work still queued (as a crashed trainer's
    device finishes or drops its queue); a fresh updater over the same memory repairs from
    the marker the stream wrote and resumes to the uninterrupted run's bits, and the next
    update (the graph's first capture for the graph updater) keeps them."""
    from unbroken.update.factory import resumable_updater

    ref, ref_regions = _build(protected=True)
    ru = resumable_updater(ref.state, ref.geometry, ref.step, ref_regions, PROT, kind="host")
    ru.initialize(-1)
    for it in range(3):
        _iterate(ref, ru, it)

    b, regions = _build(protected=True)
    su = resumable_updater(b.state, b.geometry, b.step, regions, PROT, kind=kind)
    su.initialize(-1)
    _iterate(b, su, 0)
    n = su.transactions
    target = n // 2 + 1

    seen = []

    def crash(p, iteration, step, n_steps):
        if p is phase:
            seen.append(step)
            # UPDATE/PARITY/WRITEBACK pass the transaction; MARKER passes the stage written.
            hit = len(seen) == 3 * target + 2 if p is Phase.MARKER else step == target
            if hit:
                raise _Crash

    with pytest.raises(_Crash):
        _iterate(b, su, 1, hook=crash)
    torch.cuda.synchronize()  # what a dead process's queue leaves: all of it, here
    again = resumable_updater(b.state, b.geometry, b.step, regions, PROT, kind=kind)
    report = again.repair({})
    st = again.marker.state
    assert st.stage in (Stage.SYNCED, Stage.IDLE), report
    if st.stage is Stage.SYNCED:
        again.update(1, lr=LR, grad_scale=SCALE, hook=_noop)
    assert b.state.state_hash() != ref.state.state_hash()  # the reference is one ahead
    assert _parity_consistent(again)
    _iterate(b, again, 2)
    assert b.state.state_hash() == ref.state.state_hash()
    assert _parity_consistent(again)
