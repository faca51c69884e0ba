"""The resumable updater in one process: crash at every operation of the update phase (a hook
that raises leaves memory exactly as a kill would), lose pages, repair, resume — the state must
be bit-identical to an uninterrupted run. And the ablation of Leto Fig. 12: without chunk
transactions the same crash leaves a wrong state.

The retained regions are real: memfds of a `RetainedPool` (what the state manager holds), mapped
here. Pages are lost by punching holes in them (`punch_pages`, the page-loss injector's
mechanism) and found again by the pool's localization, never handed to `repair` by the test."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator

import pytest
import torch

from unbroken.config import DataConfig, JobConfig, ModelConfig, ProtectionConfig, TrainConfig
from unbroken.engine.replica import build_training
from unbroken.erasure import UnrecoverableError
from unbroken.state import punch_pages
from unbroken.state.client import RetainedRegion
from unbroken.state.pool import RetainedPool
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


class Retained:
    """One rank's retained regions: memfds owned by a `RetainedPool`, mapped into this process
    (as a trainer maps what its state manager holds). They outlive the trainers built on them."""

    def __init__(self) -> None:
        self.pool = RetainedPool(label="test-rmu")
        self.mapped: dict[str, RetainedRegion] = {}

    def allocate(self, geometry) -> dict[str, torch.Tensor]:
        for spec in RetainedLayout.of(geometry, PROT).regions():
            region, fresh = self.pool.allocate(
                spec.name, spec.nbytes, spec.page_bytes, spec.protected
            )
            info = {**region.describe(), "fresh": fresh}
            self.mapped[spec.name] = RetainedRegion(info, [os.dup(region.fd)])
        return self.tensors()

    def tensors(self) -> dict[str, torch.Tensor]:
        return {name: region.tensor for name, region in self.mapped.items()}

    def lose(self, pages: dict[str, list[int]]) -> None:
        """Destroy pages for real: holes in the memfds (reads return zeros, contents gone)."""
        for name, idx in pages.items():
            punch_pages(self.pool.get(name), idx)

    def localize_and_remap(self) -> dict[str, list[int]]:
        """What the state manager does after a failure, before anything touches the regions:
        find the lost pages through the memory, back them with healthy zeroed pages."""
        lost, _ = self.pool.localize()
        lost = {name: pages for name, pages in lost.items() if pages}
        for name, pages in lost.items():
            self.pool.remap(name, pages)
        return lost


@pytest.fixture
def retained() -> Iterator[Retained]:
    r = Retained()
    yield r
    r.pool.close()  # the mappings go with their tensors


def _rig(retained: Retained | None = None, hooks=()):
    """A trainer and resumable updater on `retained`'s regions (None: plain local tensors,
    for the reference run); the regions are allocated, fresh, by the first rig on them."""
    cfg = _cfg()
    fresh = retained is None or not retained.mapped

    def allocate(layout, geometry, device):
        if retained is None:
            regions = {
                s.name: torch.zeros(s.nbytes, dtype=torch.uint8)
                for s in RetainedLayout.of(geometry, PROT).regions()
            }
        elif fresh:
            regions = retained.allocate(geometry)
        else:
            regions = retained.tensors()
        holder["regions"] = regions
        return state_from_regions(layout, geometry, regions), fresh

    holder: dict = {}
    built = build_training(cfg, n_shards=1, device=torch.device("cpu"), allocate=allocate)
    regions = holder["regions"]
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


def _resume(retained: Retained):
    """A replacement trainer: localize and remap lost pages, reattach, repair, finish the
    interrupted update. Returns (trainer, updater, repair report, next iteration)."""
    lost = retained.localize_and_remap()
    tr, upd, _ = _rig(retained)
    report = upd.repair(lost)
    st = upd.marker.state
    if st.stage is Stage.SYNCED:
        upd.update(st.iteration, lr=st.lr, grad_scale=st.grad_scale, hook=lambda *a: None)
    nxt = upd.marker.state.next_iteration
    return tr, upd, report, nxt


@pytest.mark.parametrize(
    ("phase", "nth"),
    [
        # CI: a crash in each phase of an iteration and in each stage of a chunk transaction;
        # the slow tier adds the first chunk's update, the first marker write, a commit and the
        # boundary (about 45 s; test_inplace_e2e crashes at every update operation in a job).
        (Phase.FORWARD, 1),
        (Phase.PROTECT, 0),
        (Phase.SYNC, 0),
        pytest.param(Phase.UPDATE, 0, marks=pytest.mark.slow),
        (Phase.UPDATE, 5),
        (Phase.PARITY, 3),
        (Phase.WRITEBACK, 2),
        pytest.param(Phase.MARKER, 0, marks=pytest.mark.slow),
        (Phase.MARKER, 7),
        pytest.param(Phase.MARKER, 8, marks=pytest.mark.slow),
        pytest.param(Phase.BOUNDARY, 0, marks=pytest.mark.slow),
    ],
)
def test_crash_anywhere_then_repair_is_bit_exact(reference, retained, phase, nth):
    tr, upd, _ = _rig(retained, hooks=[_crash_hook(phase, 2, nth)])
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
    injected = {"model": sorted(lost_model), "model_parity": lost_parity, "grads": lost_grads}
    retained.lose(injected)
    tr2, _, report, nxt = _resume(retained)
    assert report.lost_pages == injected  # localization found exactly what was destroyed
    assert report.groups_repaired >= 1
    for it in range(nxt, 4):
        tr2.run_iteration(it)
    assert tr2.state.state_hash() == reference[3]


def test_loss_beyond_tolerance_raises_and_names_the_group(retained):
    tr, upd, _ = _rig(retained)
    upd.initialize(done_iter=-1)
    tr.run_iteration(0)
    seg = upd.geometry.segment_pages
    retained.lose({"model": [0, 1, seg, seg + 1]})  # 4 data pages of group 0 > H1 = 3
    lost = retained.localize_and_remap()
    assert lost == {"model": [0, 1, seg, seg + 1]}
    with pytest.raises(UnrecoverableError, match="model/g0"):
        _rig(retained)[1].repair(lost)


def test_lost_undo_while_a_chunk_is_torn_is_unrecoverable(retained):
    tr, upd, _ = _rig(retained, hooks=[_crash_hook(Phase.PARITY, 1, 0)])
    upd.initialize(done_iter=-1)
    with pytest.raises(Crash):
        for it in range(3):
            tr.run_iteration(it)
    retained.lose({"undo": [0]})
    lost = retained.localize_and_remap()
    assert lost == {"undo": [0]}
    with pytest.raises(UnrecoverableError, match="undo"):
        _rig(retained)[1].repair(lost)


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


def test_the_factory_gives_cpu_state_the_host_marked_updater_built_once(monkeypatch):
    """Only CUDA state takes the stream or graph path; the choice is made from the inputs,
    so exactly one updater is constructed, whatever kind is asked for."""
    from unbroken.update import factory
    from unbroken.update.stream import stream_capable

    _, upd, regions = _rig()
    built: list[type] = []
    real_init = ResumableUpdater.__init__

    def counting(self, *args, **kwargs):
        built.append(type(self))
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(ResumableUpdater, "__init__", counting)
    assert not stream_capable(upd.state, regions, PROT)
    for kind in ("auto", "stream", "host"):
        built.clear()
        got = factory.resumable_updater(
            upd.state, upd.geometry, upd.step, regions, PROT, kind=kind, backend="numpy"
        )
        assert type(got) is ResumableUpdater and built == [ResumableUpdater], kind
