"""Per-stage profiles (App. C.1, input (a)): measured timings instead of a hardware model.

Owns the profile JSON format that a real run can emit and its conversion to `IterationInputs`
and `StepCosts`. A profile replaces the analytic estimates of `analytic.py` term by term; it
never mixes with them. Format (every key documented on the dataclasses below):

    {"microbatches": 8, "vpp": 2,
     "stages": [{"brackets_s": [0.10, 0.11], "p2p_s": 0.002, "extra_s": 0.0}, ...],
     "backward_window_s": 0.14,
     "grad_buckets": [{"params": 4.0e7, "seconds": 0.021}, ...],
     "update_s": 0.06, "ckpt_s": 8.3, "ckpt_load_remote_s": 8.3, "ckpt_load_local_s": 0.5,
     "rmu_s": 0.05, "gpus": 64, "replicated_optimizer": false}

`unbroken simulate --profile-from RUN_DIR` (`from_run.py`) writes this format from a real run's
records, adding `derived` (how each value was obtained) and `measured` (the run's own iteration
times, to compare with the prediction); the model never reads those two.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from unbroken.errors import UserError
from unbroken.sim._load import build, read_json
from unbroken.sim.itertime import IterationInputs, iteration_time
from unbroken.sim.policy import StepCosts

__all__ = ["GradBucket", "StageProfile", "StageTiming", "load_profile", "profile_from_dict"]


@dataclass(kw_only=True, slots=True, frozen=True)
class StageTiming:
    """One pipeline stage, one microbatch."""

    brackets_s: tuple[float, ...]
    """Forward+backward time of each bracket (contiguous layers), measured in isolation with
    intra-layer communication (TP collectives, MoE all-to-all) included."""
    p2p_s: float = 0.0
    """Inter-stage sends and receives of one microbatch (fitted send/receive curve)."""
    extra_s: float = 0.0
    """Embedding (first stage) or output head + loss (last stage)."""

    def __post_init__(self) -> None:
        if not self.brackets_s or min(self.brackets_s) < 0 or self.p2p_s < 0 or self.extra_s < 0:
            raise UserError("a stage needs non-negative brackets_s (at least one), p2p_s, extra_s")

    @property
    def total_s(self) -> float:
        """stage(s): brackets + transfers + embedding/head."""
        return sum(self.brackets_s) + self.p2p_s + self.extra_s


@dataclass(kw_only=True, slots=True, frozen=True)
class GradBucket:
    """One gradient bucket, in the order backward makes it ready."""

    seconds: float
    """Its collective's time (fitted model at its byte size, concurrency penalty applied)."""
    params: float = 0.0
    """Parameters in the bucket; only their ratios matter (ready times rho_i * W). Omit (0) on
    every bucket when the sizes are unknown: the buckets then count as equal-sized."""


@dataclass(kw_only=True, slots=True, frozen=True)
class StageProfile:
    """A measured profile of one deployment."""

    microbatches: int
    """M."""
    vpp: int = 1
    """v."""
    stages: tuple[Any, ...]
    """One `StageTiming` table per pipeline stage."""
    backward_window_s: float
    """W: the busiest stage's backward pass for one microbatch."""
    grad_buckets: tuple[Any, ...] = ()
    """`GradBucket` tables in ready order; empty when there is no DP gradient sync."""
    overlap: bool = True
    """Gradient sync overlapped with backward."""
    moe_a2a_s: float = 0.0
    """A: inter-node MoE all-to-all inside the backward window (0 if intra-node or dense)."""
    interference_dense: float = 0.0
    """c, measured differentially (C.1.3)."""
    interference_moe: float = 0.0
    """f, measured differentially (C.1.3)."""
    update_s: float
    """T_update measured (optimizer step, scalar reduction, parameter all-gather)."""
    ckpt_s: float
    """T_ckpt: excess time of a checkpointing iteration over a plain one."""
    ckpt_load_remote_s: float
    """Restoring a GPU's checkpoint from a remote host."""
    ckpt_load_local_s: float
    """Restoring it from local host memory."""
    rmu_s: float = 0.0
    """RMU's extra time per iteration."""
    gpus: int = 1
    """GPUs in the deployment."""
    replicated_optimizer: bool = False
    """Optimizer states replicated across DP ranks."""
    derived: dict[str, str] = field(default_factory=dict)
    """Provenance, not read by the model: field name -> how its value was obtained."""
    measured: dict[str, Any] = field(default_factory=dict)
    """Provenance, not read by the model: what the source run measured (e.g. its iteration
    time), to compare with the prediction."""


def load_profile(path: str | Path) -> tuple[IterationInputs, StepCosts]:
    """Read a profile JSON and return the iteration inputs and step costs it implies.

    Raises:
        UserError: unreadable file, unknown keys or invalid values (naming the file).
    """
    return profile_from_dict(read_json(path), str(path))


def profile_from_dict(raw: Any, where: str) -> tuple[IterationInputs, StepCosts]:
    """`load_profile` on an already parsed profile object; `where` names it in errors.

    Raises:
        UserError: unknown keys or invalid values.
    """
    prof = build(StageProfile, raw, where)
    stages = tuple(
        build(StageTiming, s, f"{where}: stages[{i}]") for i, s in enumerate(prof.stages)
    )
    buckets = tuple(
        build(GradBucket, b, f"{where}: grad_buckets[{i}]") for i, b in enumerate(prof.grad_buckets)
    )
    if not stages:
        raise UserError(f"{where}: stages must list at least one stage")
    sizes = tuple(b.params for b in buckets)
    if sizes and not any(sizes):
        sizes = (1.0,) * len(sizes)  # sizes unknown: equal buckets
    elif any(p <= 0 for p in sizes):
        raise UserError(f"{where}: give params > 0 on every grad bucket, or on none")
    try:
        inputs = IterationInputs(
            microbatches=prof.microbatches,
            vpp=prof.vpp,
            stage_s=tuple(s.total_s for s in stages),
            backward_window_s=prof.backward_window_s,
            bucket_s=tuple(b.seconds for b in buckets),
            bucket_params=sizes,
            overlap=prof.overlap,
            moe_a2a_s=prof.moe_a2a_s,
            interference_dense=prof.interference_dense,
            interference_moe=prof.interference_moe,
            update_s=prof.update_s,
        )
    except UserError as exc:
        raise UserError(f"{where}: {exc}") from None
    steps = StepCosts(
        t_iter_s=iteration_time(inputs).iter_s,
        t_ckpt_s=prof.ckpt_s,
        load_remote_s=prof.ckpt_load_remote_s,
        load_local_s=prof.ckpt_load_local_s,
        rmu_s=prof.rmu_s,
        gpus=prof.gpus,
        replicated_optimizer=prof.replicated_optimizer,
    )
    return inputs, steps
