"""Young's checkpoint interval (Leto A.2): I* = sqrt(2 p MTTF / t_iter) iterations, with
p = checkpoint cost / t_iter, i.e. I* = sqrt(2 C MTTF) / t_iter for a cost of C seconds."""

from __future__ import annotations

import math

__all__ = ["young_interval"]


def young_interval(ckpt_cost_s: float, mttf_s: float, iter_s: float, max_iters: int) -> int:
    """Checkpoint interval in whole iterations, clamped to [1, max_iters].

    Args:
        ckpt_cost_s: measured extra seconds an iteration spends saving a checkpoint.
        mttf_s: mean time between the failures that need the checkpoint.
        iter_s: uncheckpointed iteration time.
        max_iters: the longest interval allowed (e.g. the run length).
    """
    if iter_s <= 0 or mttf_s <= 0:
        raise ValueError("iter_s and mttf_s must be positive")
    if not math.isfinite(mttf_s):
        return max_iters
    ideal = math.sqrt(2.0 * max(ckpt_cost_s, 0.0) * mttf_s) / iter_s
    return max(1, min(max_iters, round(ideal)))
