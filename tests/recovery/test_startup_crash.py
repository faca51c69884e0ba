"""A trainer that dies in its start-up, after its retained regions exist but before its first
progress-marker write, leaves regions that never held progress. That is not a loss: the next
generation must say so and, when no rank completed an iteration, start every rank where the job
stands (its initial state) in place — not report the marker as unrecoverable and send the job
through checkpoint-restart. (Found by the mid-takeover kill test, whose first kill sometimes
landed in generation 0's start-up.)

Retained regions are local tensors here, left as a dead generation 0 left them; two gloo ranks
run the next generation's `restore_state` on them.
"""

from __future__ import annotations

import pickle
import traceback
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from unbroken.config import (
    CheckpointConfig,
    DataConfig,
    JobConfig,
    ModelConfig,
    ProtectionConfig,
    TrainConfig,
)
from unbroken.erasure import UnrecoverableError
from unbroken.update.layout import MARKER_PAGE, RetainedLayout
from unbroken.update.marker import SLOT_BYTES

PROT = ProtectionConfig(page_bytes=4096, stripe_pages=2, parity_pages=3, chunk_bytes=1024)
WORLD = 2
ITERATIONS = 2


def _cfg(tmp: Path) -> JobConfig:
    return JobConfig(
        model=ModelConfig(preset="tiny"),
        data=DataConfig(tokens_per_microbatch=64, microbatches=2, max_documents=100),
        train=TrainConfig(iterations=ITERATIONS, lr=1e-3),
        checkpoint=CheckpointConfig(dir=str(tmp / "checkpoints")),
        protection=PROT,
    )


def _trainer(cfg: JobConfig, regions: dict | None, rank: int, group):
    """A trainer of `rank` on `regions` (None: new ones, zeroed and initialized, as the state
    manager's fresh regions are). Returns (regions, built, updater, trainer)."""
    from unbroken.engine.replica import build_training
    from unbroken.train import Trainer
    from unbroken.update.rmu import ResumableUpdater, state_from_regions

    fresh = regions is None

    def allocate(layout, geometry, device):
        nonlocal regions
        if regions is None:
            regions = {
                s.name: torch.zeros(s.nbytes, dtype=torch.uint8)
                for s in RetainedLayout.of(geometry, PROT).regions()
            }
        return state_from_regions(layout, geometry, regions), fresh

    built = build_training(cfg, n_shards=WORLD, device=torch.device("cpu"), allocate=allocate)
    upd = ResumableUpdater(built.state, built.geometry, built.step, regions, PROT, backend="numpy")
    tr = Trainer(
        model=built.model,
        state=built.state,
        source=built.source,
        shard=rank,
        cfg=cfg.train,
        group=group,
        device=torch.device("cpu"),
        updater=upd,
    )
    return regions, built, upd, tr


def _generation_0(cfg: JobConfig, how: str, rank: int) -> dict:
    """The regions a generation-0 trainer left when it died `how`."""
    regions, built, upd, _ = _trainer(cfg, None, rank, None)
    if how == "before its first marker write":
        # Died while still initializing its parameters, before `initialize`.
        built.state.params[: built.state.params.numel() // 2].fill_(7.0)
    elif how == "in its first marker write":
        upd.initialize(done_iter=-1)  # then take the write back to half of it
        slot1 = regions["marker"][SLOT_BYTES : 2 * SLOT_BYTES]
        slot1[SLOT_BYTES // 4 :].zero_()
        regions["marker"][MARKER_PAGE:].zero_()  # nor was the marker's parity encoded
    elif how == "after initializing":
        upd.initialize(done_iter=-1)
    elif how == "after completing iteration 3":
        upd.initialize(done_iter=3)
    else:
        raise ValueError(how)
    return regions


class _Events:
    def __init__(self) -> None:
        self.seen: list[dict] = []

    def emit(self, kind: str, **fields) -> None:
        self.seen.append({"kind": kind, **fields})


def _generation_1(cfg: JobConfig, regions: dict, rank: int, group, tmp: Path) -> dict:
    """The next generation's restore on `regions`; then the iterations, if it resumed."""
    from unbroken.checkpoint.policy import CheckpointPolicy
    from unbroken.launch.restore import restore_state
    from unbroken.launch.retained import RetainedState
    from unbroken.recovery import RestoreMode

    _, built, upd, tr = _trainer(cfg, regions, rank, group)
    retained = RetainedState(
        cfg,
        client=None,
        regions={n: SimpleNamespace(tensor=t, fresh=False) for n, t in regions.items()},
        fresh=False,
        lost={},
    )
    spec = SimpleNamespace(
        restore=RestoreMode.IN_PLACE, resume=True, generation=1, run_dir=str(tmp), run_name="t"
    )
    events = _Events()
    start = restore_state(
        spec=spec,
        cfg=cfg,
        rank=rank,
        executor=SimpleNamespace(updater=upd, state=built.state, reinit=None),
        retained=retained,
        group=group,
        events=events,
        hook=tr._hook,
        checkpoints=CheckpointPolicy(
            cfg.checkpoint,
            Path(cfg.checkpoint.dir),
            iterations=ITERATIONS,
            board=None,
            rank=rank,
            group=group,
            emit=events.emit,
        ),
    )
    outcome = None if start is None else (start,)
    result = {"start": None if outcome is None else outcome[0], "events": events.seen}
    if outcome is not None:
        for it in range(outcome[0], ITERATIONS):
            tr.run_iteration(it)
        result["hash"] = tr.state.state_hash()
    return result


SCENARIOS = {
    "start over": ("before its first marker write", "after initializing"),
    "start over, torn first write": ("in its first marker write", "before its first marker write"),
    "fallback": ("before its first marker write", "after completing iteration 3"),
}
"""Scenario -> how each rank's generation-0 trainer died."""


def _rank(rank: int, tmp: str) -> None:
    import torch.distributed as dist

    tmp_path = Path(tmp)
    torch.set_num_threads(1)
    try:
        store = dist.FileStore(str(tmp_path / "store"), WORLD)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=WORLD, timeout=timedelta(seconds=60)
        )
        group = dist.group.WORLD
        cfg = _cfg(tmp_path)
        _, _, upd, tr = _trainer(cfg, None, rank, group)  # an uninterrupted job
        upd.initialize(done_iter=-1)
        for it in range(ITERATIONS):
            tr.run_iteration(it)
        out: dict = {"reference": tr.state.state_hash()}
        for name, how in SCENARIOS.items():
            regions = _generation_0(cfg, how[rank], rank)
            out[name] = _generation_1(cfg, regions, rank, group, tmp_path / name)
        (tmp_path / f"rank{rank}.pkl").write_bytes(pickle.dumps(out))
    except BaseException:
        (tmp_path / f"error-{rank}.txt").write_text(traceback.format_exc())
        raise


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> list[dict]:
    import torch.multiprocessing as mp

    tmp = tmp_path_factory.mktemp("startup-crash")
    try:
        mp.start_processes(_rank, args=(str(tmp),), nprocs=WORLD, start_method="spawn")
    except Exception as exc:
        detail = "\n".join(p.read_text() for p in sorted(tmp.glob("error-*.txt")))
        raise AssertionError(f"ranks failed: {exc}\n{detail}") from None
    return [pickle.loads((tmp / f"rank{r}.pkl").read_bytes()) for r in range(WORLD)]


def test_a_marker_never_written_is_nothing_retained_not_a_loss(tmp_path):
    from unbroken.update.rmu import NothingRetained

    cfg = _cfg(tmp_path)
    for how in ("before its first marker write", "in its first marker write"):
        regions = _generation_0(cfg, how, 0)
        before = {n: t.clone() for n, t in regions.items()}
        _, _, upd, _ = _trainer(cfg, regions, 0, None)
        with pytest.raises(NothingRetained):
            upd.repair({})
        assert all(torch.equal(regions[n], before[n]) for n in regions)  # nothing touched
    # A marker that was written and then lost beyond its parity is still a loss.
    regions = _generation_0(cfg, "after initializing", 0)
    regions["marker"].zero_()
    with pytest.raises(UnrecoverableError, match="marker"):
        _trainer(cfg, regions, 0, None)[2].repair({"marker": [0, 1, 2]})


@pytest.mark.parametrize("scenario", ["start over", "start over, torn first write"])
def test_ranks_that_retained_no_progress_start_over_in_place(outcomes, scenario):
    for out in outcomes:
        r = out[scenario]
        assert r["start"] == 0, r["events"]
        kinds = [e["kind"] for e in r["events"]]
        assert kinds == ["inplace_repair"], r["events"]
        assert r["events"][0]["action"].startswith("no rank retained progress")
        assert r["hash"] == out["reference"]  # the same state as the job that never died


def test_a_rank_that_retained_nothing_beside_peers_with_progress_falls_back(outcomes):
    assert [out["fallback"]["start"] for out in outcomes] == [None, None]
    (fallback,) = outcomes[0]["fallback"]["events"]
    assert fallback["kind"] == "inplace_fallback"
    assert "peers made progress" in fallback["reason"]
    assert outcomes[1]["fallback"]["events"] == []
