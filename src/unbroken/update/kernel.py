"""The per-chunk optimizer step shared by every updater (see [Note: chunk-geometry])."""

from __future__ import annotations

import torch

from unbroken.train.optim import AdamW
from unbroken.update.geometry import ChunkRef, StateGeometry

__all__ = ["ChunkStep"]


class ChunkStep:
    """Applies AdamW to one chunk of the striped state, with weight decay only on elements
    below `decay_end` (the matrices of the flat layout)."""

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
        decay = self._decay(ref)
        p = g.chunk_view(params, ref)
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
