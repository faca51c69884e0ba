"""The resumable updater in one process: crash at every operation of the update phase (a hook
that raises leaves memory exactly as a kill would), lose pages, repair, resume — the state must
be bit-identical to an uninterrupted run. And the ablation of Leto Fig. 12: without chunk
transactions the same crash leaves a wrong state."""

from __future__ import annotations

import random

import pytest
import torch

from unbroken.config import DataConfig, JobConfig, ModelConfig, ProtectionConfig, TrainConfig
from unbroken.engine.replica import build_training
from unbroken.erasure import UnrecoverableError
from unbroken.train import Phase, Trainer
from unbroken.update import PlainUpdater
from unbroken.update.layout import RetainedLayout
from unbroken.update.marker import Stage
from unbroken.update.rmu import ResumableUpdater, state_from_regions

PROT = ProtectionConfig(page_bytes=4096, stripe_pages=2, parity_pages=3, chunk_bytes=1024)


class Crash(Exception):
    pass


def _cfg() -> JobConfig:
    return JobConfig(
        model=ModelConfig(preset="tiny"),
        data=DataConfig(tokens_per_microbatch=64, microbatches=2, max_documents=100),
        train=TrainConfig(iterations=8, lr=1e-3),
        protection=PROT,
    )


def _rig(regions=None, hooks=()):
    cfg = _cfg()
    fresh = regions is None
    holder = {}

    def allocate(layout, geometry, device):
        nonlocal regions
        if regions is None:
            regions = {
                s.name: torch.zeros(s.nbytes, dtype=torch.uint8)
                for s in RetainedLayout.of(geometry, PROT).regions()
            }
        holder["geometry"] = geometry
        return state_from_regions(layout, geometry, regions), fresh

    built = build_training(cfg, n_shards=1, device=torch.device("cpu"), allocate=allocate)
    upd = ResumableUpdater(built.state, built.geometry, built.step, regions, PROT, backend="numpy")
    tr = Trainer(
        model=built.model,
        state=built.state,
        source=built.source,
        shard=0,
        cfg=cfg.train,
        group=None,
        device=torch.device("cpu"),
        hooks=list(hooks),
        updater=upd,
    )
    return tr, upd, regions


def _reference_hashes(n=4):
    tr, upd, _ = _rig()
    upd.initialize(done_iter=-1)
    out = []
    for it in range(n):
        tr.run_iteration(it)
        out.append(tr.state.state_hash())
    return out


@pytest.fixture(scope="module")
def reference():
    return _reference_hashes()


def _crash_hook(phase: Phase, it: int, nth: int):
    seen = {"n": 0}

    def hook(ph, iteration, step, n_steps):
        if ph is phase and iteration == it:
            if seen["n"] == nth:
                raise Crash(f"{phase} #{nth}")
            seen["n"] += 1

    return hook


def _resume(regions, lost: dict[str, list[int]]):
    """A replacement trainer: reattach, repair, finish the interrupted update, continue."""
    tr, upd, _ = _rig(regions)
    report = upd.repair(lost)
    st = upd.marker.state
    if st.stage is Stage.SYNCED:
        upd.update(st.iteration, lr=st.lr, grad_scale=st.grad_scale, hook=lambda *a: None)
    nxt = upd.marker.state.next_iteration
    return tr, upd, report, nxt


def _punch(regions, name, pages, page_bytes):
    for p in pages:
        regions[name][p * page_bytes : (p + 1) * page_bytes].zero_()


@pytest.mark.parametrize(
    ("phase", "nth"),
    [
        (Phase.FORWARD, 1),
        (Phase.PROTECT, 0),
        (Phase.SYNC, 0),
        (Phase.UPDATE, 0),
        (Phase.UPDATE, 5),
        (Phase.PARITY, 3),
        (Phase.WRITEBACK, 2),
        (Phase.MARKER, 0),
        (Phase.MARKER, 7),
        (Phase.MARKER, 8),
        (Phase.BOUNDARY, 0),
    ],
)
def test_crash_anywhere_then_repair_is_bit_exact(reference, phase, nth):
    tr, upd, regions = _rig(hooks=[_crash_hook(phase, 2, nth)])
    upd.initialize(done_iter=-1)
    with pytest.raises(Crash):
        for it in range(4):
            tr.run_iteration(it)
    rng = random.Random(f"{phase}{nth}")
    geometry = upd.geometry
    # Lose up to H1 pages of one model group (data and a parity page) and some gradient pages.
    g = rng.randrange(geometry.groups)
    seg = geometry.segment_pages
    data = [sg * seg + g * 2 + p for sg in range(3) for p in range(2)]
    lost_model = rng.sample(data, 2)
    lost_parity = [g * (PROT.parity_pages + 1) + rng.randrange(PROT.parity_pages)]
    lost_grads = [rng.randrange(seg)]
    for name, pages in [
        ("model", lost_model),
        ("model_parity", lost_parity),
        ("grads", lost_grads),
    ]:
        _punch(regions, name, pages, 4096)
    tr2, _, report, nxt = _resume(
        regions, {"model": lost_model, "model_parity": lost_parity, "grads": lost_grads}
    )
    assert report.groups_repaired >= 1
    for it in range(nxt, 4):
        tr2.run_iteration(it)
    assert tr2.state.state_hash() == reference[3]


def test_loss_beyond_tolerance_raises_and_names_the_group():
    tr, upd, regions = _rig()
    upd.initialize(done_iter=-1)
    tr.run_iteration(0)
    seg = upd.geometry.segment_pages
    lost = [0, 1, seg, seg + 1]  # 4 data pages of group 0 > H1 = 3
    _punch(regions, "model", lost, 4096)
    with pytest.raises(UnrecoverableError, match="model/g0"):
        _rig(regions)[1].repair({"model": lost})


def test_lost_undo_while_a_chunk_is_torn_is_unrecoverable():
    tr, upd, regions = _rig(hooks=[_crash_hook(Phase.PARITY, 1, 0)])
    upd.initialize(done_iter=-1)
    with pytest.raises(Crash):
        for it in range(3):
            tr.run_iteration(it)
    with pytest.raises(UnrecoverableError, match="undo"):
        _rig(regions)[1].repair({"undo": [0]})


def test_ablation_without_chunk_transactions_diverges(reference):
    """Leto Fig. 12: parity but no transactions — a crash inside the update, resumed by redoing
    the iteration (the only option without an undo buffer and marker), gives a wrong state."""
    cfg = _cfg()
    built = build_training(cfg, n_shards=1, device=torch.device("cpu"))
    plain = PlainUpdater(built.state, built.geometry, built.step)
    hook = _crash_hook(Phase.UPDATE, 2, 5)
    tr = Trainer(
        model=built.model,
        state=built.state,
        source=built.source,
        shard=0,
        cfg=cfg.train,
        group=None,
        device=torch.device("cpu"),
        hooks=[hook],
        updater=plain,
    )
    with pytest.raises(Crash):
        for it in range(4):
            tr.run_iteration(it)
    tr.hooks = []
    for it in range(2, 4):  # redo the interrupted iteration on the torn state
        tr.run_iteration(it)
    assert tr.state.state_hash() != reference[3]
