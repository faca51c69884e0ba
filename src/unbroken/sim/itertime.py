"""Iteration-time model of Leto App. C.1: T_iter = T_pipeline + T_sync + T_update.

Owns the arithmetic from per-stage timings to one iteration's time: the pipeline formula
(M + (S-1)/v) * max_s stage(s), the gradient-bucket queue that gives the exposed communication
E = max(0, f_n - W) (C.1.3), the dense and MoE interference terms, and the update time. The
inputs (`IterationInputs`) come either from a measured per-stage profile (`profile.py`) or from a
hardware + model description (`analytic.py`); this module never looks at where they came from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from unbroken.errors import UserError

__all__ = [
    "IterationBreakdown",
    "IterationInputs",
    "bucket_exposure",
    "iteration_time",
    "megatron_bucket_params",
    "pipeline_time",
]


def megatron_bucket_params(dp: int) -> float:
    """Megatron's gradient-bucket size in parameters: max(40M, 1M * d_p) (C.1.3)."""
    return max(40e6, 1e6 * dp)


@dataclass(kw_only=True, slots=True, frozen=True)
class IterationInputs:
    """Per-stage timings and sync/update terms that determine one iteration's time."""

    microbatches: int
    """M: microbatches per pipeline per iteration."""
    vpp: int = 1
    """v: virtual-pipeline interleaving degree."""
    stage_s: tuple[float, ...]
    """stage(s) for each pipeline stage s: one microbatch's forward+backward over the stage's
    brackets, its inter-stage transfers, and the embedding or head+loss where present."""
    backward_window_s: float
    """W: the backward pass of the last microbatch on the busiest stage, during which the
    gradient buckets become ready."""
    bucket_s: tuple[float, ...] = ()
    """w_i: transfer time of each gradient bucket in ready order, concurrency penalty applied."""
    bucket_params: tuple[float, ...] = ()
    """Parameters in each bucket, same order (gives rho_i)."""
    overlap: bool = True
    """Gradient sync overlapped with backward."""
    moe_a2a_s: float = 0.0
    """A: inter-node MoE all-to-all time inside the backward window; 0 when the all-to-all
    stays within a node (then no interference constant applies to it)."""
    interference_dense: float = 0.0
    """c (C.1.3), used when `moe_a2a_s` is 0."""
    interference_moe: float = 0.0
    """f (C.1.3), used when `moe_a2a_s` > 0."""
    update_s: float
    """T_update: optimizer step + scalar reduction (+ parameter all-gather when sharded)."""

    def __post_init__(self) -> None:
        if self.microbatches < 1 or self.vpp < 1:
            raise UserError("microbatches and vpp must be >= 1")
        if not self.stage_s or min(self.stage_s) < 0:
            raise UserError("stage_s needs one non-negative time per pipeline stage")
        if len(self.bucket_s) != len(self.bucket_params):
            raise UserError("bucket_s and bucket_params must have the same length")
        if self.backward_window_s < 0 or self.update_s < 0 or self.moe_a2a_s < 0:
            raise UserError("backward_window_s, update_s and moe_a2a_s must be >= 0")
        if any(w < 0 for w in self.bucket_s) or any(p <= 0 for p in self.bucket_params):
            raise UserError("bucket times must be >= 0 and bucket sizes > 0")


@dataclass(kw_only=True, slots=True, frozen=True)
class IterationBreakdown:
    """The terms of T_iter, all in seconds."""

    pipeline_s: float
    """T_pipeline."""
    sync_serial_s: float
    """T_sync with overlap disabled: the sum of bucket transfer times."""
    exposed_s: float
    """E (or E' for inter-node MoE): gradient communication left after the backward window."""
    sync_s: float
    """T_sync as charged to the iteration (T_sync^on when overlapped)."""
    update_s: float
    """T_update."""

    @property
    def iter_s(self) -> float:
        """T_iter = T_pipeline + T_sync + T_update."""
        return self.pipeline_s + self.sync_s + self.update_s


def pipeline_time(microbatches: int, stage_s: tuple[float, ...], vpp: int = 1) -> float:
    """T_pipeline = (M + (S - 1) / v) * max_s stage(s)."""
    stages = len(stage_s)
    return (microbatches + (stages - 1) / vpp) * max(stage_s)


def bucket_exposure(
    bucket_s: tuple[float, ...], bucket_params: tuple[float, ...], window_s: float
) -> tuple[float, float]:
    """Replay the one-collective-in-flight bucket queue over a backward window.

    Bucket i is ready at r_i = rho_i * W (rho_i: cumulative parameter fraction) and finishes at
    f_i = max(r_i, f_{i-1}) + w_i, f_0 = 0.

    Returns:
        (E, f_n): the exposed communication max(0, f_n - W) and the last finish time.
    """
    total = sum(bucket_params)
    finish = 0.0
    cumulative = 0.0
    for w, p in zip(bucket_s, bucket_params, strict=True):
        cumulative += p
        ready = cumulative / total * window_s
        finish = max(ready, finish) + w
    return max(0.0, finish - window_s), finish


def iteration_time(inp: IterationInputs) -> IterationBreakdown:
    """Predict one iteration's time and its terms (Leto App. C.1)."""
    t_pipe = pipeline_time(inp.microbatches, inp.stage_s, inp.vpp)
    t_sync = sum(inp.bucket_s)
    if not inp.bucket_s:
        return IterationBreakdown(
            pipeline_s=t_pipe, sync_serial_s=0.0, exposed_s=0.0, sync_s=0.0, update_s=inp.update_s
        )
    if not inp.overlap:
        return IterationBreakdown(
            pipeline_s=t_pipe,
            sync_serial_s=t_sync,
            exposed_s=t_sync,
            sync_s=t_sync,
            update_s=inp.update_s,
        )
    if inp.moe_a2a_s > 0:
        # Two flows on one bottleneck: the sharing delay lies in [0, min(G, A)].
        delay = inp.interference_moe * min(t_sync, inp.moe_a2a_s)
        exposed, _ = bucket_exposure(inp.bucket_s, inp.bucket_params, inp.backward_window_s + delay)
        sync_on = exposed + delay
    else:
        exposed, _ = bucket_exposure(inp.bucket_s, inp.bucket_params, inp.backward_window_s)
        sync_on = exposed + inp.interference_dense * (t_sync - exposed)
    if not math.isfinite(sync_on):
        raise UserError("iteration model produced a non-finite sync time; check the inputs")
    return IterationBreakdown(
        pipeline_s=t_pipe,
        sync_serial_s=t_sync,
        exposed_s=exposed,
        sync_s=sync_on,
        update_s=inp.update_s,
    )
