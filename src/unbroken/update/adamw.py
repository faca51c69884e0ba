"""AdamW as a `ChunkRule`: the arithmetic of `unbroken.train.optim.AdamW` (torch's AdamW term by
term) on the CPU, and the fused Triton kernel (`unbroken.update.fused_adamw`) on a CUDA device
for every chunk with nothing frozen whose decay is all, none, or a prefix of the flat state (the
plain updater's condition for its one launch), so chunked and whole-state updates keep the same
bits."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from unbroken.train.optim import AdamW
from unbroken.train.state import TrainState
from unbroken.update.fused_adamw import AdamWCoefficients, fused_adamw_, fused_available
from unbroken.update.rule import ChunkContext, Ranges

__all__ = ["AdamWRule", "adamw_chunk"]


def adamw_chunk(
    opt: AdamW, p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, ctx
) -> None:
    """One AdamW step of a chunk (or of gathered elements) in place; `ctx.decay` as a bool or a
    mask shaped like the views."""
    decay = ctx.decay
    if isinstance(decay, torch.Tensor):
        factor = torch.where(decay.to(p.device), 1.0 - ctx.lr * opt.weight_decay, 1.0)
        p.mul_(factor.to(p.dtype))
        decay = False
    opt.update_range(p, g, m, v, step=ctx.step, lr=ctx.lr, grad_scale=ctx.grad_scale, decay=decay)


class AdamWRule:
    """AdamW over chunks (slots: exp_avg, exp_avg_sq)."""

    name = "adamw"
    slots = ("exp_avg", "exp_avg_sq")
    passes = 1

    def __init__(self, opt: AdamW, padded_numel: int) -> None:
        self.opt = opt
        self.padded_numel = padded_numel

    def ranges(self) -> Mapping[str, Ranges]:
        return {}

    def derive(self, pass_: int, state: TrainState, **scalars) -> None:
        return None

    def apply(self, pass_: int, p, g, slots, ctx: ChunkContext) -> None:
        m, v = slots
        if p.is_cuda and ctx.frozen is False and fused_available():
            # One launch per chunk (see fused_adamw), which decides decay per element from
            # `decay_end`: every chunk then computes the bits of the plain updater's one launch
            # over the whole state, a chunk across the decay boundary included.
            if ctx.decay_end is not None:
                end = ctx.decay_end
            elif isinstance(ctx.decay, bool):
                end = self.padded_numel if ctx.decay else 0
            else:
                end = None
            if end is not None:
                coeffs = AdamWCoefficients.of(
                    self.opt, step=ctx.step, lr=ctx.lr, grad_scale=ctx.grad_scale
                )
                fused_adamw_(p, g, m, v, coeffs, first_index=ctx.first_index, decay_end=end)
                return
        adamw_chunk(self.opt, p, g, m, v, ctx)
