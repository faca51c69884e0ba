"""A trainer that dies in its start-up, after its retained regions exist but before its first
progress-marker write, leaves regions that never held progress. That is not a loss: the next
generation must say so and, when no rank completed an iteration, start every rank where the job
stands (its initial state) in place — not report the marker as unrecoverable and send the job
through checkpoint-restart. (Found by the mid-takeover kill test, whose first kill sometimes
landed in generation 0's start-up.)

Each rank's retained regions are real: its own state manager process holds them (memfds), a
generation-0 trainer maps them through `RetainedState`, damages them as its death would and lets
go; the next generation maps them again (localization and remap included) and two gloo ranks run
its `restore_state` on them.
"""

from __future__ import annotations

import pickle
import subprocess
import sys
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
from unbroken.update.layout import MARKER_PAGE
from unbroken.update.marker import SLOT_BYTES

from ..state.conftest import manager_env

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


class StateManager:
    """One rank's state manager process (`python -m unbroken.state.manager`), as the agent runs
    it: it owns the retained regions across trainer generations."""

    def __init__(self, socket_path: Path, rank: int) -> None:
        from unbroken.state.client import RetainedClient

        self.socket = socket_path
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "unbroken.state.manager", "--socket", str(socket_path),
             "--rank", str(rank), "--log-level", "WARNING"],
            env=manager_env(),
        )  # fmt: skip
        RetainedClient(socket_path, timeout_s=60).close()  # serving

    def attach(self, cfg: JobConfig):
        """What a trainer of a new generation holds: a `RetainedState` on a new connection."""
        from unbroken.launch.retained import RetainedState
        from unbroken.state.client import RetainedClient

        return RetainedState(cfg, RetainedClient(self.socket, timeout_s=60))

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def _trainer(cfg: JobConfig, retained, rank: int, group):
    """A trainer of `rank` on `retained`'s regions, mapped (and, if retained from an earlier
    generation, localized and remapped) by `RetainedState.allocate`. Returns (built, updater,
    trainer)."""
    from unbroken.engine.replica import build_training
    from unbroken.train import Trainer
    from unbroken.update.rmu import ResumableUpdater

    built = build_training(
        cfg, n_shards=WORLD, device=torch.device("cpu"), allocate=retained.allocate
    )
    upd = ResumableUpdater(
        built.state, built.geometry, built.step, retained.tensors(), PROT, backend="numpy"
    )
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
    return built, upd, tr


def _generation_0(cfg: JobConfig, how: str, rank: int, manager: StateManager) -> None:
    """A generation-0 trainer on fresh regions of `manager`, dying `how`."""
    retained = manager.attach(cfg)
    built, upd, _ = _trainer(cfg, retained, rank, None)
    assert retained.fresh
    regions = retained.tensors()
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
    retained.client.close()  # the trainer is gone; its manager keeps the regions


class _Events:
    def __init__(self) -> None:
        self.seen: list[dict] = []

    def emit(self, kind: str, **fields) -> None:
        self.seen.append({"kind": kind, **fields})


def _generation_1(cfg: JobConfig, manager: StateManager, rank: int, group, tmp: Path) -> dict:
    """The next generation's restore on the retained regions; then the iterations, if it
    resumed."""
    from unbroken.checkpoint.policy import CheckpointPolicy
    from unbroken.launch.restore import restore_state
    from unbroken.recovery import RestoreMode

    retained = manager.attach(cfg)
    built, upd, tr = _trainer(cfg, retained, rank, group)
    assert not retained.fresh and retained.lost == {}  # retained, and nothing was lost
    spec = SimpleNamespace(
        restore=RestoreMode.IN_PLACE, resume=True, generation=1, run_dir=str(tmp), run_name="t"
    )
    events = _Events()
    start = restore_state(
        spec=spec,
        cfg=cfg,
        rank=rank,
        # No replica sets: ranks that each hold their own state (a rank with nothing
        # retained cannot be filled from a peer, tests/recovery/test_decision.py).
        executor=SimpleNamespace(updater=upd, state=built.state, reinit=None, replica_sets=()),
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
    managers: list[StateManager] = []
    try:
        store = dist.FileStore(str(tmp_path / "store"), WORLD)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=WORLD, timeout=timedelta(seconds=60)
        )
        group = dist.group.WORLD
        cfg = _cfg(tmp_path)
        reference = StateManager(tmp_path / f"ref-{rank}.sock", rank)
        managers.append(reference)
        _, upd, tr = _trainer(cfg, reference.attach(cfg), rank, group)  # an uninterrupted job
        upd.initialize(done_iter=-1)
        for it in range(ITERATIONS):
            tr.run_iteration(it)
        out: dict = {"reference": tr.state.state_hash()}
        for i, (name, how) in enumerate(SCENARIOS.items()):
            manager = StateManager(tmp_path / f"s{i}-{rank}.sock", rank)
            managers.append(manager)
            _generation_0(cfg, how[rank], rank, manager)
            out[name] = _generation_1(cfg, manager, rank, group, tmp_path / name)
        (tmp_path / f"rank{rank}.pkl").write_bytes(pickle.dumps(out))
    except BaseException:
        (tmp_path / f"error-{rank}.txt").write_text(traceback.format_exc())
        raise
    finally:
        for manager in managers:
            manager.stop()


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
    for i, how in enumerate(("before its first marker write", "in its first marker write")):
        manager = StateManager(tmp_path / f"m{i}.sock", 0)
        try:
            _generation_0(cfg, how, 0, manager)
            retained = manager.attach(cfg)
            _, upd, _ = _trainer(cfg, retained, 0, None)
            before = {n: t.clone() for n, t in retained.tensors().items()}
            with pytest.raises(NothingRetained):
                upd.repair(retained.lost or {})
            after = retained.tensors()
            assert all(torch.equal(after[n], before[n]) for n in before)  # nothing touched
        finally:
            manager.stop()
    # A marker that was written and then lost beyond its parity is still a loss.
    manager = StateManager(tmp_path / "m2.sock", 0)
    try:
        _generation_0(cfg, "after initializing", 0, manager)
        from unbroken.state import punch_pages

        retained = manager.attach(cfg)
        probe = retained.client.attach("marker")  # the injector's view: punch all three pages
        punch_pages(probe, [0, 1, 2])
        _, upd, _ = _trainer(cfg, retained, 0, None)
        assert retained.lost == {"marker": [0, 1, 2]}  # found by localization
        with pytest.raises(UnrecoverableError, match="marker"):
            upd.repair(retained.lost)
    finally:
        manager.stop()


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
