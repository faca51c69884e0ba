"""AdamW over element ranges of flat buffers, and the learning-rate schedule (Leto A.1).

Hand-written instead of `torch.optim.AdamW` because the update must run on any element range
[a, b) of the flat state (chunk transactions of the resumable updater), must leave the gradient
buffer untouched (clipping is a scalar applied inside the update, so a redone chunk computes the
same result), and takes its step count from the iteration, not from hidden optimizer state.
The arithmetic follows torch's AdamW (decoupled decay, bias corrections) term by term.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from unbroken.config import TrainConfig

__all__ = ["AdamW", "lr_at"]


def lr_at(cfg: TrainConfig, iteration: int) -> float:
    """Linear warm-up over warmup_frac of the run, then cosine to min_lr_frac * peak."""
    total = cfg.iterations
    warm = max(1, round(cfg.warmup_frac * total)) if cfg.warmup_frac > 0 else 0
    if iteration < warm:
        return cfg.lr * (iteration + 1) / warm
    progress = (iteration - warm) / max(1, total - warm)
    floor = cfg.lr * cfg.min_lr_frac
    return floor + (cfg.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


@dataclass(frozen=True, slots=True)
class AdamW:
    """Stateless AdamW: all state is in the caller's flat buffers."""

    beta1: float
    beta2: float
    eps: float
    weight_decay: float

    @classmethod
    def from_config(cls, cfg: TrainConfig) -> AdamW:
        return cls(beta1=cfg.beta1, beta2=cfg.beta2, eps=cfg.eps, weight_decay=cfg.weight_decay)

    def update_range(
        self,
        params: torch.Tensor,
        grads: torch.Tensor,
        exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor,
        *,
        step: int,
        lr: float,
        grad_scale: float,
        decay: bool,
    ) -> None:
        """Update params/moments in place from grads * grad_scale (grads are not modified).

        Args:
            step: 1-based optimizer step (bias correction).
            grad_scale: clipping coefficient (1.0 = no clipping).
            decay: apply decoupled weight decay to this range.
        """
        g = grads if grad_scale == 1.0 else grads * grad_scale
        if decay and self.weight_decay:
            params.mul_(1.0 - lr * self.weight_decay)
        exp_avg.lerp_(g, 1.0 - self.beta1)
        exp_avg_sq.mul_(self.beta2).addcmul_(g, g, value=1.0 - self.beta2)
        bias1 = 1.0 - self.beta1**step
        bias2 = 1.0 - self.beta2**step
        denom = (exp_avg_sq.sqrt() / math.sqrt(bias2)).add_(self.eps)
        params.addcdiv_(exp_avg, denom, value=-lr / bias1)
