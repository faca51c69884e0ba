"""Recovery policies and their costs: what each failure costs and what steady overhead it adds.

Owns the per-policy terms of Leto App. C.3 (equations 7 and 8 and their siblings): the
effective iteration time T_eff, the checkpoint interval I from Young's formula (App. A.2), and
for each failure kind the detection time, the replacement-trainer initialization time and the
expected lost work L in iterations. Policies:

- ``gemini``: in-memory checkpoints in remote host memory (Gemini); a HOF restarts the trainer
  in place, a fatal failure starts an uninitialized spare; both reload and roll back.
- ``gemini+``: the same checkpoints, with a preinitialized spare for every failure (Gemini+,
  TrainMover-style): no process start, but rank setup and a remote checkpoint load remain.
- ``jit``: just-in-time checkpointing: a surviving data-parallel replica saves its state after
  the failure, so only the in-flight iteration is lost; needs replicated optimizer states.
- ``inplace``: unbroken's (Leto's) in-place recovery: a HOF promotes the shadow trainer onto the
  retained state (no load, no rollback); fatal failures fall back to checkpoint-restart
  (``gemini+``, or ``jit`` when the optimizer is replicated, as Leto §8.1 does), with the interval
  set from the fatal-failure MTTF M/(1-h).

Fail-slow failures are handled by eviction: the job runs at 1/`fail_slow_factor` speed for
`fail_slow_detect_s`, then the straggler is replaced like a fatal failure.

This module computes expectations only; `des.py` plays the same terms out event by event.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from unbroken.errors import UserError
from unbroken.sim._load import check_range

__all__ = [
    "KINDS",
    "POLICIES",
    "FailureMix",
    "KindCost",
    "PolicyTerms",
    "RecoveryConfig",
    "StepCosts",
    "policy_terms",
    "young_interval",
]

POLICIES = ("inplace", "gemini+", "gemini", "jit")
KINDS = ("hof", "fatal", "fail-slow")


@dataclass(kw_only=True, slots=True, frozen=True)
class RecoveryConfig:
    """Time costs of the recovery steps that are software, not bandwidth (paper measurements)."""

    detect_s: float = 1.0
    """T_det: failure detection. Leto §8.1: a monitor detects a killed trainer in under 1 s."""
    process_start_s: float = 24.0
    """Launching a trainer: interpreter, framework import, CUDA context, buffers. What a
    preinitialized spare saves: Gemini init 59 s - Gemini+ init 35 s (Leto Table 3)."""
    rank_setup_s: float = 25.7
    """Rank-specific setup a spare cannot do ahead (communicators, connections to peers):
    Gemini+ init 35 s - T_det 1 s - its checkpoint load 8.3 s on Kimi-MoE (Table 3; the load
    is this model's remote-load time for Kimi-MoE on a100-p4d, see docs "Calibration")."""
    comm_init_per_gpu_s: float = 0.0
    """Extra communicator setup per GPU in the job, added to `rank_setup_s` for every policy
    that rebuilds communicators. 0 = as measured at 64 GPUs; MegaScale (NSDI'24) reports ~2.4 ms
    per GPU at 2k-10k GPUs after optimization, a pessimistic setting for large jobs."""
    takeover_s: float = 13.0
    """Shadow takeover in place: coordinated role switch, reattaching retained state, page
    localization and reconstruction. Leto Table 3: init 15 s (I=11) and 13 s (I=32), minus T_det."""
    ckpt_usable_lag: int = 1
    """Iterations after a checkpoint's boundary until it can be restored. Gemini: 1 (its remote
    transfer completes at the next iteration's step, App. C.3); a synchronous save: 0."""
    ckpt_interval: int = 0
    """Fixed checkpoint interval in iterations for every checkpointing policy; 0 = Young's
    formula per policy (App. A.2). Use it to replay an experiment run at a given interval."""
    max_interval: int = 128
    """Cap on the checkpoint interval in iterations, used when Young's formula gives none (no
    fatal failures, h = 1) or a larger one. Leto §8.1 uses "the largest interval tested"."""
    fail_slow_detect_s: float = 60.0
    """Time a fail-slow GPU runs degraded before it is detected and evicted (assumed)."""
    fail_slow_factor: float = 2.0
    """Slowdown of the whole job while a fail-slow GPU is in it (assumed)."""

    def __post_init__(self) -> None:
        for name in ("detect_s", "process_start_s", "rank_setup_s", "takeover_s"):
            check_range(self, name, 0.0, 1e6)
        check_range(self, "comm_init_per_gpu_s", 0.0, 10.0)
        check_range(self, "ckpt_usable_lag", 0, 16)
        check_range(self, "max_interval", 1, 10**9)
        check_range(self, "ckpt_interval", 0, 10**9)
        check_range(self, "fail_slow_detect_s", 0.0, 1e6)
        check_range(self, "fail_slow_factor", 1.0, 1e3)


@dataclass(kw_only=True, slots=True, frozen=True)
class FailureMix:
    """How often failures arrive and of which kind."""

    mttf_s: float
    """Mean time between failures of the whole job, elapsed time (recovery included)."""
    hof_ratio: float
    """h: fraction of failures that are hardware-operable."""
    fail_slow_ratio: float = 0.0
    """Fraction that are fail-slow; the rest (1 - h - this) are fatal."""

    def __post_init__(self) -> None:
        if not self.mttf_s > 0:
            raise UserError(f"mttf_s must be > 0, got {self.mttf_s!r}")
        check_range(self, "hof_ratio", 0.0, 1.0)
        check_range(self, "fail_slow_ratio", 0.0, 1.0)
        if self.hof_ratio + self.fail_slow_ratio > 1.0 + 1e-12:
            raise UserError("hof_ratio + fail_slow_ratio must not exceed 1")

    @property
    def fractions(self) -> dict[str, float]:
        """Probability of each failure kind."""
        fatal = max(0.0, 1.0 - self.hof_ratio - self.fail_slow_ratio)
        return {"hof": self.hof_ratio, "fatal": fatal, "fail-slow": self.fail_slow_ratio}


@dataclass(kw_only=True, slots=True, frozen=True)
class StepCosts:
    """The workload's measured or modelled per-step times that the policies combine."""

    t_iter_s: float
    """T_iter: fault-free iteration time without any fault-tolerance mechanism."""
    t_ckpt_s: float
    """T_ckpt: excess time of an iteration that commits an in-memory checkpoint."""
    load_remote_s: float
    """Restoring one GPU's checkpoint shard from a remote host (spare-based recovery)."""
    load_local_s: float
    """Restoring it from local host memory (in-place restart), or a JIT save to host."""
    rmu_s: float = 0.0
    """RMU's extra time per iteration (in-place policy only); omega = rmu_s / t_iter_s."""
    gpus: int = 1
    """GPUs in the job (scales `comm_init_per_gpu_s`)."""
    replicated_optimizer: bool = False
    """Optimizer states replicated across DP ranks (JIT checkpointing needs it)."""


@dataclass(kw_only=True, slots=True, frozen=True)
class KindCost:
    """What one failure of one kind costs under one policy."""

    detect_s: float
    """T_det."""
    init_s: float
    """T_init: preparing the replacement trainer(s) and restoring state."""
    lost_iters: float
    """L: expected lost work in iterations (closed form); the DES derives it from the schedule."""
    rollback: bool
    """True when recovery restores the newest usable checkpoint (lost work grows with I)."""
    degraded_s: float = 0.0
    """Extra time lost before recovery starts (fail-slow: running degraded until eviction)."""


@dataclass(kw_only=True, slots=True, frozen=True)
class PolicyTerms:
    """All policy-specific terms of the ETTR model for one scenario."""

    policy: str
    """One of POLICIES."""
    applicable: bool
    """False when the policy cannot run this workload (JIT with sharded optimizer states)."""
    reason: str
    """Why not applicable, else empty."""
    t_iter_s: float
    """T_iter."""
    omega: float
    """Per-iteration steady overhead fraction of RMU (in-place only)."""
    t_ckpt_s: float
    """T_ckpt charged every `interval` iterations (0 when no periodic checkpoints)."""
    interval: int
    """Checkpoint interval I in iterations (0 when no periodic checkpoints)."""
    usable_lag: int
    """Iterations until a checkpoint becomes restorable."""
    costs: dict[str, KindCost]
    """Per failure kind."""

    @property
    def t_eff_s(self) -> float:
        """T_eff = (1 + omega) T_iter + T_ckpt / I."""
        ckpt = self.t_ckpt_s / self.interval if self.interval else 0.0
        return (1.0 + self.omega) * self.t_iter_s + ckpt


def young_interval(t_ckpt_s: float, mttf_s: float, t_iter_s: float, cap: int) -> int:
    """Young's optimal interval in iterations, I* = sqrt(2 p MTTF / t_iter) with
    p = T_ckpt / t_iter (App. A.2), rounded to a whole number in [1, cap]; `cap` when MTTF is
    infinite (no failures that need a checkpoint)."""
    if math.isinf(mttf_s):
        return cap
    p = t_ckpt_s / t_iter_s
    return int(min(cap, max(1, round(math.sqrt(2.0 * p * mttf_s / t_iter_s)))))


def _lost(interval: int, lag: int) -> float:
    """Expected lost iterations under rollback: between `lag` and I + lag - 1 completed
    iterations ((I-1)/2 + lag on average) plus half the in-flight one: I/2 + lag (App. C.3)."""
    return interval / 2.0 + lag


def policy_terms(
    policy: str, steps: StepCosts, mix: FailureMix, rec: RecoveryConfig | None = None
) -> PolicyTerms:
    """The ETTR-model terms of `policy` for a workload with `steps` under failures `mix`.

    Raises:
        UserError: unknown policy name.
    """
    rec = rec or RecoveryConfig()
    if policy not in POLICIES:
        raise UserError(f"unknown policy {policy!r} (known: {', '.join(POLICIES)})")
    c = _Costing(rec, steps)
    common = {"t_iter_s": steps.t_iter_s, "usable_lag": rec.ckpt_usable_lag, "policy": policy}
    if policy == "jit":
        if not steps.replicated_optimizer:
            return PolicyTerms(
                applicable=False,
                reason="JIT checkpointing needs replicated optimizer states (sharded here)",
                omega=0.0,
                t_ckpt_s=0.0,
                interval=0,
                costs=c.jit_costs(),
                **common,
            )
        return PolicyTerms(
            applicable=True,
            reason="",
            omega=0.0,
            t_ckpt_s=0.0,
            interval=0,
            costs=c.jit_costs(),
            **common,
        )
    if policy in ("gemini", "gemini+"):
        return _gemini_terms(policy, c, mix, common)
    return _inplace_terms(c, mix, common)


class _Costing:
    """Per failure kind, what recovering costs under checkpoint rollback or JIT checkpointing,
    from the recovery config and the workload's step costs."""

    def __init__(self, rec: RecoveryConfig, steps: StepCosts) -> None:
        self.rec, self.steps = rec, steps
        comm = rec.rank_setup_s + rec.comm_init_per_gpu_s * steps.gpus
        self.restart = rec.process_start_s + comm  # an uninitialized trainer (in place or spare)
        self.spare_plus = comm  # a preinitialized spare still sets up its rank
        self.slow = rec.fail_slow_detect_s * (1.0 - 1.0 / rec.fail_slow_factor)

    def ckpt_costs(self, interval: int, hof_init: float, fatal_init: float) -> dict[str, KindCost]:
        rec = self.rec
        lost = _lost(interval, rec.ckpt_usable_lag)
        return {
            "hof": KindCost(detect_s=rec.detect_s, init_s=hof_init, lost_iters=lost, rollback=True),
            "fatal": KindCost(
                detect_s=rec.detect_s, init_s=fatal_init, lost_iters=lost, rollback=True
            ),
            "fail-slow": KindCost(
                detect_s=rec.detect_s,
                init_s=fatal_init,
                lost_iters=lost,
                rollback=True,
                degraded_s=self.slow,
            ),
        }

    def jit_costs(self, spare: bool = False) -> dict[str, KindCost]:
        # A surviving replica saves its state to host memory (JIT), the replacement loads it.
        # JIT+ (spare=True) replaces the failed trainer with a preinitialized spare.
        rec, steps = self.rec, self.steps
        save = steps.load_local_s
        hof = self.restart + save + steps.load_local_s
        fatal = (self.spare_plus if spare else self.restart) + save + steps.load_remote_s
        return {
            "hof": KindCost(detect_s=rec.detect_s, init_s=hof, lost_iters=0.5, rollback=False),
            "fatal": KindCost(detect_s=rec.detect_s, init_s=fatal, lost_iters=0.5, rollback=False),
            "fail-slow": KindCost(
                detect_s=rec.detect_s,
                init_s=fatal,
                lost_iters=0.5,
                rollback=False,
                degraded_s=self.slow,
            ),
        }


def _gemini_terms(policy: str, c: _Costing, mix: FailureMix, common: dict) -> PolicyTerms:
    """Gemini: checkpoints to peers' host memory at the Young interval; gemini+ restarts on a
    preinitialized spare."""
    steps, rec = c.steps, c.rec
    interval = rec.ckpt_interval or young_interval(
        steps.t_ckpt_s, mix.mttf_s, steps.t_iter_s, rec.max_interval
    )
    if policy == "gemini":
        costs = c.ckpt_costs(
            interval, c.restart + steps.load_local_s, c.restart + steps.load_remote_s
        )
    else:
        costs = c.ckpt_costs(
            interval, c.spare_plus + steps.load_remote_s, c.spare_plus + steps.load_remote_s
        )
    return PolicyTerms(
        applicable=True,
        reason="",
        omega=0.0,
        t_ckpt_s=steps.t_ckpt_s,
        interval=interval,
        costs=costs,
        **common,
    )


def _inplace_terms(c: _Costing, mix: FailureMix, common: dict) -> PolicyTerms:
    """In place: HOFs promote the shadow; everything else falls back to a checkpoint system
    (JIT+ with replicated optimizer states, as Leto §8.1 does; else checkpoints at the Young
    interval of the fatal failures alone)."""
    steps, rec = c.steps, c.rec
    omega = steps.rmu_s / steps.t_iter_s
    hof = KindCost(detect_s=rec.detect_s, init_s=rec.takeover_s, lost_iters=0.5, rollback=False)
    if steps.replicated_optimizer:
        costs = c.jit_costs(spare=True)  # JIT+ for fatal failures, as Leto §8.1 does
        costs["hof"] = hof
        return PolicyTerms(
            applicable=True,
            reason="",
            omega=omega,
            t_ckpt_s=0.0,
            interval=0,
            costs=costs,
            **common,
        )
    ff_rate = (1.0 - mix.hof_ratio) / mix.mttf_s
    ff_mttf = math.inf if ff_rate <= 0 else 1.0 / ff_rate
    interval = rec.ckpt_interval or young_interval(
        steps.t_ckpt_s, ff_mttf, steps.t_iter_s, rec.max_interval
    )
    costs = c.ckpt_costs(interval, 0.0, c.spare_plus + steps.load_remote_s)
    costs["hof"] = hof
    return PolicyTerms(
        applicable=True,
        reason="",
        omega=omega,
        t_ckpt_s=steps.t_ckpt_s,
        interval=interval,
        costs=costs,
        **common,
    )
