"""The per-chunk optimizer step shared by every updater (see [Note: chunk-geometry])."""

from __future__ import annotations

import torch

from unbroken.train.optim import AdamW
from unbroken.update.fused_adamw import AdamWCoefficients, fused_adamw_, fused_available
from unbroken.update.geometry import ChunkRef, StateGeometry

__all__ = ["ChunkStep"]


class ChunkStep:
    """Applies AdamW to one chunk of the striped state, with weight decay only on elements
    below `decay_end` (the matrices of the flat layout). On a CUDA device the chunk is one
    fused kernel launch (`unbroken.update.fused_adamw`); on the CPU, the eager reference."""

    def __init__(self, geometry: StateGeometry, optimizer: AdamW, decay_end: int) -> None:
        self.geometry = geometry
        self.optimizer = optimizer
        self.decay_end = decay_end
        self._decay_masks: dict[tuple[int, int], torch.Tensor | bool] = {}

    def _decay(self, ref: ChunkRef) -> torch.Tensor | bool:
        key = (ref.group, ref.chunk)
        mask = self._decay_masks.get(key)
        if mask is None:
            idx = self.geometry.element_index(ref)
            if bool((idx < self.decay_end).all()):
                mask = True
            elif bool((idx >= self.decay_end).all()):
                mask = False
            else:
                mask = idx < self.decay_end
            self._decay_masks[key] = mask
        return mask

    def __call__(
        self,
        ref: ChunkRef,
        params: torch.Tensor,
        grads: torch.Tensor,
        exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor,
        *,
        step: int,
        lr: float,
        grad_scale: float,
    ) -> None:
        g = self.geometry
        p = g.chunk_view(params, ref)
        if p.is_cuda and fused_available():  # one launch per chunk (see fused_adamw)
            coeffs = AdamWCoefficients.of(self.optimizer, step=step, lr=lr, grad_scale=grad_scale)
            first = ref.group * g.stripe_pages * g.elems_per_page + ref.byte_lo // 4
            views = (g.chunk_view(t, ref) for t in (grads, exp_avg, exp_avg_sq))
            fused_adamw_(p, *views, coeffs, first_index=first, decay_end=self.decay_end)
            return
        decay = self._decay(ref)
        if isinstance(decay, torch.Tensor):
            factor = torch.where(decay.to(p.device), 1.0 - lr * self.optimizer.weight_decay, 1.0)
            p.mul_(factor.to(p.dtype))
            decay = False
        self.optimizer.update_range(
            p,
            g.chunk_view(grads, ref),
            g.chunk_view(exp_avg, ref),
            g.chunk_view(exp_avg_sq, ref),
            step=step,
            lr=lr,
            grad_scale=grad_scale,
            decay=decay,
        )
