"""The `slow` fault: spec parsing, where the injector stalls (compute steps vs all-reduce buckets)
and by how much, the trainer's ALLREDUCE/REDUCED hook contract, and that stalling never changes
the training state."""

from __future__ import annotations

import types

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


def _drive(spec: str, iterations: int = 8):
    clock, events = Clock(), []
    inj = Injector(
        [parse_fault(spec)],
        rank=1,
        store=JobStore(dist.HashStore()),
        emit=lambda kind, **f: events.append((kind, f)),
        job_t0=0.0,
        sleep=clock.sleep,
        clock=clock,
    )
    per_iter = []
    for it in range(iterations):
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


# -- the trainer's hook contract and bit-exactness --------------------------------------------


class TwoReplicas:
    """Stands in for `torch.distributed` in the loop: a world of 2 identical replicas."""

    def __init__(self, log: list) -> None:
        self.log = log

    def get_world_size(self, group) -> int:
        return 2

    def all_reduce(self, t: torch.Tensor, group=None) -> None:
        self.log.append(("all_reduce", t.numel()))
        t.mul_(2)  # the sum of two identical replicas


def _trainer(monkeypatch, hooks, log, bucket):
    monkeypatch.setattr(loop_module, "dist", TwoReplicas(log))
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
        shard=0,
        cfg=cfg.train,
        group=types.SimpleNamespace(),
        device=torch.device("cpu"),
        hooks=hooks,
        updater=PlainUpdater(b.state, b.geometry, b.step),
        reduce_bucket=bucket,
    )


def test_allreduce_hook_fires_once_right_before_each_bucket_then_reduced(monkeypatch):
    log: list = []
    hooks = [lambda phase, it, step, n: log.append((phase, step, n))]
    timer = PhaseTimer(rank=0)
    trainer = _trainer(monkeypatch, [*hooks, timer], log, bucket=40_000)
    trainer.run_iteration(0)
    numel = trainer.state.grads.numel()
    n = -(-numel // 40_000)
    assert n >= 3
    i = log.index((Phase.ALLREDUCE, 0, n))
    expected = []
    for b in range(n):
        expected += [(Phase.ALLREDUCE, b, n), ("all_reduce", min(40_000, numel - b * 40_000))]
    assert log[i : i + 2 * n + 1] == [*expected, (Phase.REDUCED, 0, 1)]
    assert log[i - 1] == (Phase.BACKWARD, 1, 2) and log[i + 2 * n + 1] == (Phase.PROTECT, 0, 1)
    (rec,) = timer.records
    assert len(rec.mb_s) == 2 and rec.comm_s > 0


def test_slow_faults_never_change_the_training_state(monkeypatch):
    def run(faults):
        log: list = []
        inj = Injector(
            [parse_fault(f) for f in faults],
            0,
            JobStore(dist.HashStore()),
            lambda *a, **k: None,
            0.0,
        )
        trainer = _trainer(monkeypatch, [inj], log, bucket=40_000)
        for it in range(3):
            trainer.run_iteration(it)
        return trainer.state.state_hash(), inj

    clean, _ = run([])
    slowed, inj = run(["slow:rank=0,iter=0,factor=1.2", "slow:rank=0,iter=1,factor=1.5,what=comm"])
    assert inj.slow_factor == 1.2 and inj.comm_stall_s  # both faults really stalled
    assert slowed == clean
