"""The `slow` fault: spec parsing, where the injector stalls (compute steps vs all-reduce buckets)
and by how much, the trainer's ALLREDUCE/REDUCED hook contract, and that stalling never changes
the training state."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from unbroken.config import DataConfig, JobConfig, ModelConfig, TrainConfig
from unbroken.detect.levels import LEVEL_LOSS, Level, slow_factor_for, throughput_loss
from unbroken.detect.timing import PhaseTimer
from unbroken.engine.replica import build_training
from unbroken.errors import UserError
from unbroken.inject import Injector, SlowTarget, parse_fault
from unbroken.jobstore import JobStore
from unbroken.train import Trainer
from unbroken.train import loop as loop_module
from unbroken.train.phases import Phase
from unbroken.update import PlainUpdater

from ..engine.harness import gloo_rank, spawn_ranks

# -- spec -------------------------------------------------------------------------------------


def test_slow_spec_round_trips_with_what_and_level():
    f = parse_fault("slow:rank=1,iter=20,what=comm,level=medium")
    assert (f.what, f.level, f.factor) == (SlowTarget.COMM, Level.MEDIUM, 1.0)
    assert parse_fault(f.text()) == f
    g = parse_fault("slow:rank=0,iter=3,factor=2.5")
    assert g.what is SlowTarget.COMPUTE and g.level is None and g.factor == 2.5
    assert "what" not in g.text()


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("slow:rank=1,iter=2,what=disk,factor=2", "what='disk' is not one of compute|comm"),
        ("slow:rank=1,iter=2,level=mild", "level='mild' is not one of weak|medium|severe"),
        ("slow:rank=1,iter=2,level=weak,factor=2", "factor=F or level=L, not both"),
        ("slow:rank=1,iter=2", "slow needs factor > 1 or level="),
        ("kill:rank=1,iter=2,what=comm", "unknown field(s) ['what']"),
        ("slow:rank=1,iter=5,factor=2,until=5", "until must be after iter"),
        ("kill:rank=1,iter=2,until=4", "unknown field(s) ['until']"),
        ("kill:rank=1,iter=2,phase=allreduse", "phase='allreduse' is not one of"),
    ],
)
def test_bad_slow_specs_fail_with_one_clear_line(spec, message):
    with pytest.raises(UserError) as err:
        parse_fault(spec)
    text = str(err.value)
    assert message in text and spec in text and "\n" not in text


# -- where and how long the injector stalls ---------------------------------------------------


class Clock:
    """Fake time; `sleep` advances it and records (stall, previous hook's phase)."""

    def __init__(self) -> None:
        self.now = 0.0
        self.stalls: list[tuple[float, Phase]] = []
        self.prev: Phase | None = None

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.stalls.append((s, self.prev))
        self.now += s


# Step durations of one iteration: 2 micro-batches, 3 all-reduce buckets, 2 update chunks.
FWD, BWD, BUCKET, TAIL = 1.0, 2.0, 0.1, 0.05
STEPS = [
    *[(p, m, 2, d) for m in range(2) for p, d in ((Phase.FORWARD, FWD), (Phase.BACKWARD, BWD))],
    *[(Phase.ALLREDUCE, b, 3, BUCKET) for b in range(3)],
    (Phase.REDUCED, 0, 1, TAIL),
    (Phase.PROTECT, 0, 1, TAIL),
    (Phase.SYNC, 0, 1, TAIL),
    *[(Phase.UPDATE, k, 2, TAIL) for k in range(2)],
    (Phase.BOUNDARY, 0, 1, TAIL),
]
PERIOD = sum(d for *_, d in STEPS)
COMM = 3 * BUCKET


def _drive(spec: str, iterations: int = 8, *, store: JobStore | None = None, start: int = 0):
    """Run one trainer's injector over iterations start..iterations-1 on fake time; `store`:
    the job's (an earlier trainer's fired faults)."""
    clock, events = Clock(), []
    inj = Injector(
        [parse_fault(spec)],
        rank=1,
        store=store or JobStore(dist.HashStore()),
        emit=lambda kind, **f: events.append((kind, f)),
        job_t0=0.0,
        sleep=clock.sleep,
        clock=clock,
    )
    per_iter = [[] for _ in range(start)]
    for it in range(start, iterations):
        before = len(clock.stalls)
        for phase, step, n, d in STEPS:
            inj(phase, it, step, n)
            clock.prev = phase
            clock.now += d
        per_iter.append(clock.stalls[before:])
    return per_iter, events


def test_compute_slow_stalls_every_step_but_the_all_reduce():
    per_iter, events = _drive("slow:rank=1,iter=3,factor=2")
    assert all(not s for s in per_iter[:3])  # before the fault
    for stalls in per_iter[4:]:
        assert Phase.ALLREDUCE not in {prev for _, prev in stalls}
        assert sum(s for s, _ in stalls) == pytest.approx(PERIOD - COMM)  # (F - 1) x compute
    assert [k for k, _ in events] == ["failure_injected", "slow_active"]


@pytest.mark.parametrize("what", ["compute", "comm"])
def test_a_slow_fault_with_until_stops_stalling_at_that_iteration(what):
    spec = "slow:rank=1,iter=3,factor=2,until=6" + (",what=comm" if what == "comm" else "")
    fault = parse_fault(spec)
    assert fault.until == 6 and parse_fault(fault.text()) == fault
    per_iter, events = _drive(spec, iterations=9)
    assert all(per_iter[4:6])  # stalling while the device is slow
    assert not any(per_iter[7:])  # (iteration 6's first hook may stall for 5's last step)
    ended = dict(events)["slow_ended"]
    assert [k for k, _ in events][-1] == "slow_ended" and ended["iter"] == 6


def test_a_slow_fault_with_until_stalls_a_trainer_started_on_the_device_before_it_ends():
    # The planned stop of a re-plan that moves layers starts a new trainer on the slow device
    # at iteration 5: the device is still slow (until 8), so the new trainer stalls too.
    store = JobStore(dist.HashStore())
    spec = "slow:rank=1,iter=3,factor=2,until=8"
    first, _ = _drive(spec, iterations=5, store=store)
    assert all(first[4:5])
    second, events = _drive(spec, iterations=11, store=store, start=5)
    assert [k for k, _ in events] == ["slow_resumed", "slow_active", "slow_ended"]
    assert dict(events)["slow_resumed"]["iter"] == 5
    assert all(second[6:8]) and not any(second[9:])
    for stalls in second[6:8]:
        assert sum(s for s, _ in stalls) == pytest.approx(PERIOD - COMM)  # (F - 1) x compute
    # Ended before this trainer started, or ended at all (a restart that redoes iterations
    # before `until`), or without `until` (the process's life): no stall.
    _, events = _drive(spec, iterations=11, store=store, start=8)
    assert events == []
    again, events = _drive(spec, iterations=8, store=store, start=4)
    assert events == [] and not any(again)
    store = JobStore(dist.HashStore())
    _drive("slow:rank=1,iter=3,factor=2", iterations=5, store=store)
    later, events = _drive("slow:rank=1,iter=3,factor=2", iterations=9, store=store, start=5)
    assert events == [] and not any(later)


def test_comm_slow_stalls_only_after_each_bucket_by_its_healthy_time():
    per_iter, events = _drive("slow:rank=1,iter=3,factor=5,what=comm")
    assert all(not s for s in per_iter[:3])
    for stalls in per_iter[3:]:
        assert [prev for _, prev in stalls] == [Phase.ALLREDUCE] * 3  # once per bucket
        assert [s for s, _ in stalls] == pytest.approx([4 * BUCKET] * 3)
    active = dict(events)["slow_active"]
    assert active["what"] == "comm" and active["factor"] == 5.0
    assert active["comm_s"] == pytest.approx(COMM)


@pytest.mark.parametrize("level", list(Level))
def test_comm_level_costs_its_throughput_share_of_the_healthy_iteration(level):
    per_iter, events = _drive(f"slow:rank=1,iter=3,level={level.value},what=comm")
    stall = sum(s for s, _ in per_iter[5])
    # The stall per iteration is L / (1 - L) of the healthy iteration: loss L.
    assert 1 - PERIOD / (PERIOD + stall) == pytest.approx(LEVEL_LOSS[level])
    active = dict(events)["slow_active"]
    assert active["comm_share"] == pytest.approx(COMM / PERIOD)
    assert throughput_loss(active["factor"], active["comm_share"]) == pytest.approx(
        LEVEL_LOSS[level]
    )


def test_compute_level_uses_the_level_factor():
    per_iter, events = _drive("slow:rank=1,iter=3,level=severe")
    assert dict(events)["slow_active"]["factor"] == pytest.approx(slow_factor_for("severe"))
    stall = sum(s for s, _ in per_iter[5])
    assert stall == pytest.approx((slow_factor_for("severe") - 1) * (PERIOD - COMM))


def test_comm_slow_fired_in_the_first_iteration_waits_for_a_healthy_one():
    per_iter, events = _drive("slow:rank=1,iter=0,factor=3,what=comm", iterations=3)
    assert per_iter[0] == []  # nothing to calibrate on yet
    assert [k for k, _ in events] == ["failure_injected", "slow_active"]
    assert len(per_iter[1]) == 3 and len(per_iter[2]) == 3


# -- the trainer's hook contract and bit-exactness, on two real gloo replicas ----------------
# Two ranks, not one: a one-rank trainer has no gradient all-reduce (no ALLREDUCE hooks, nothing
# for a comm fault to stretch).

REDUCE_BUCKET = 40_000
SLOW_FAULTS = ["slow:rank=0,iter=0,factor=1.2", "slow:rank=0,iter=1,factor=1.5,what=comm"]


def _trainer(rank: int, group, hooks):
    cfg = JobConfig(
        model=ModelConfig(preset="tiny"),
        data=DataConfig(tokens_per_microbatch=64, microbatches=2, max_documents=200),
        train=TrainConfig(iterations=3, lr=1e-3),
    )
    b = build_training(cfg, n_shards=2, device=torch.device("cpu"))
    return Trainer(
        model=b.model,
        state=b.state,
        source=b.source,
        shard=rank,
        cfg=cfg.train,
        group=group,
        device=torch.device("cpu"),
        hooks=hooks,
        updater=PlainUpdater(b.state, b.geometry, b.step),
        reduce_bucket=REDUCE_BUCKET,
    )


def _hook_contract(rank: int, group) -> dict:
    """One iteration with a hook that logs every phase step and a spy on the real all-reduce
    (it logs the call, then makes it)."""
    log: list = []
    timer = PhaseTimer(rank=rank)
    trainer = _trainer(
        rank, group, [lambda phase, it, step, n: log.append((phase, step, n)), timer]
    )
    real = loop_module.dist.all_reduce

    def spy(t, *args, **kwargs):
        log.append(("all_reduce", t.numel()))
        return real(t, *args, **kwargs)

    loop_module.dist.all_reduce = spy
    try:
        trainer.run_iteration(0)
    finally:
        loop_module.dist.all_reduce = real
    (rec,) = timer.records
    return {
        "log": log,
        "numel": trainer.state.grads.numel(),
        "mb": len(rec.mb_s),
        "comm_s": rec.comm_s,
    }


def _train(rank: int, group, faults: list[str]) -> dict:
    inj = Injector(
        [parse_fault(f) for f in faults],
        rank,
        JobStore(dist.HashStore()),
        lambda *a, **k: None,
        0.0,
    )
    trainer = _trainer(rank, group, [inj])
    for it in range(3):
        trainer.run_iteration(it)
    return {
        "hash": trainer.state.state_hash(),
        "factor": inj.slow_factor,
        "comm_stall_s": inj.comm_stall_s,
    }


def _replica(rank: int, world_size: int, store_path: str, _payload, out: str) -> None:
    record: dict = {}
    with gloo_rank(rank, world_size, store_path, out, record) as group:
        record["contract"] = _hook_contract(rank, group)
        record["clean"] = _train(rank, group, [])
        record["slowed"] = _train(rank, group, SLOW_FAULTS)


@pytest.fixture(scope="module")
def replicas(tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("slow-replicas")
    preload = ["torch", "torch.distributed", "unbroken.engine.replica", __name__]
    return spawn_ranks(_replica, None, 2, tmp, preload, "two replicas")


def test_allreduce_hook_fires_once_right_before_each_bucket_then_reduced(replicas):
    for rank, record in enumerate(replicas):
        c = record["contract"]
        log, numel = c["log"], c["numel"]
        n = -(-numel // REDUCE_BUCKET)
        assert n >= 3
        i = log.index((Phase.ALLREDUCE, 0, n))
        expected = []
        for b in range(n):
            expected += [
                (Phase.ALLREDUCE, b, n),
                ("all_reduce", min(REDUCE_BUCKET, numel - b * REDUCE_BUCKET)),
            ]
        assert log[i : i + 2 * n + 1] == [*expected, (Phase.REDUCED, 0, 1)], f"rank {rank}"
        assert log[i - 1] == (Phase.BACKWARD, 1, 2) and log[i + 2 * n + 1] == (Phase.PROTECT, 0, 1)
        assert c["mb"] == 2 and c["comm_s"] > 0


def test_slow_faults_never_change_the_training_state(replicas):
    slow, other = replicas
    buckets = -(-slow["contract"]["numel"] // REDUCE_BUCKET)
    assert slow["slowed"]["factor"] == 1.2  # both faults really stalled: compute, and ...
    assert sorted(slow["slowed"]["comm_stall_s"]) == list(range(buckets))  # ... every bucket
    assert other["slowed"]["factor"] == 1.0 and not other["slowed"]["comm_stall_s"]
    for rank, record in enumerate(replicas):
        assert record["slowed"]["hash"] == record["clean"]["hash"], f"rank {rank}"
    assert slow["clean"]["hash"] == other["clean"]["hash"]  # replicas hold one state
