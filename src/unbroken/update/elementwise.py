"""Element-wise rules besides AdamW: SGD with momentum and Lion, one pass each (every chunk's
new values depend only on its own old values, so any chunking computes the same bits).

SGD follows `torch.optim.SGD` term by term (coupled L2 weight decay added to the gradient,
the momentum buffer initialized to the first gradient, dampening, Nesterov). Lion follows Chen
et al. 2023 ("Symbolic Discovery of Optimization Algorithms", Algorithm 2) in the arithmetic
of the authors' reference code: decoupled decay, sign of the beta1-interpolation, then the
beta2 momentum update.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from unbroken.train.state import TrainState
from unbroken.update.rule import ChunkContext, Ranges

__all__ = ["LionRule", "SGDRule"]


def _decay_factor(p: torch.Tensor, ctx: ChunkContext, weight_decay: float) -> torch.Tensor | float:
    """1 - lr·wd where the chunk decays, 1 elsewhere (a scalar when uniform)."""
    decay = ctx.decay
    if isinstance(decay, torch.Tensor):
        return torch.where(decay.to(p.device), 1.0 - ctx.lr * weight_decay, 1.0).to(p.dtype)
    return 1.0 - ctx.lr * weight_decay if decay else 1.0


class _Elementwise:
    passes = 1

    def ranges(self) -> Mapping[str, Ranges]:
        return {}

    def derive(self, pass_: int, state: TrainState, **scalars) -> None:
        return None


class SGDRule(_Elementwise):
    """SGD with momentum (slot: momentum_buffer)."""

    name = "sgd"
    slots = ("momentum_buffer",)

    def __init__(
        self, *, momentum: float, dampening: float, nesterov: bool, weight_decay: float
    ) -> None:
        self.momentum = momentum
        self.dampening = dampening
        self.nesterov = nesterov
        self.weight_decay = weight_decay

    def apply(self, pass_: int, p, g, slots, ctx: ChunkContext) -> None:
        (buf,) = slots
        d_p = ctx.scaled(g)
        if self.weight_decay and ctx.decay is not False:
            decayed = d_p.add(p, alpha=self.weight_decay)
            d_p = (
                decayed if ctx.decay is True else torch.where(ctx.decay.to(p.device), decayed, d_p)
            )
        if self.momentum:
            if ctx.step == 1:
                buf.copy_(d_p)
            else:
                buf.mul_(self.momentum).add_(d_p, alpha=1.0 - self.dampening)
            d_p = d_p.add(buf, alpha=self.momentum) if self.nesterov else buf
        p.add_(d_p, alpha=-ctx.lr)


class LionRule(_Elementwise):
    """Lion (slot: exp_avg, the momentum)."""

    name = "lion"
    slots = ("exp_avg",)

    def __init__(self, *, beta1: float, beta2: float, weight_decay: float) -> None:
        self.beta1 = beta1
        self.beta2 = beta2
        self.weight_decay = weight_decay

    def apply(self, pass_: int, p, g, slots, ctx: ChunkContext) -> None:
        (m,) = slots
        grad = ctx.scaled(g)
        if self.weight_decay:
            factor = _decay_factor(p, ctx, self.weight_decay)
            if not (isinstance(factor, float) and factor == 1.0):
                p.mul_(factor)
        update = m.clone().mul_(self.beta1).add(grad, alpha=1.0 - self.beta1).sign_()
        p.add_(update, alpha=-ctx.lr)
        m.mul_(self.beta2).add_(grad, alpha=1.0 - self.beta2)
