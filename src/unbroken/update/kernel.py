"""The per-chunk optimizer step shared by every updater (see [Note: chunk-geometry]).

Which elements of a chunk get weight decay and which are frozen comes from element ranges of
the flat layout (`FlatLayout.decay_ranges`, `frozen_ranges`; [Note: shared parameters] in
`unbroken.model.flat`), turned into one mask per chunk on first use. A chunk entirely inside
(or outside) a range takes the scalar path, so the common layouts (matrices first, vectors
after) compute exactly what a single decay boundary did.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from unbroken.model.flat import FlatLayout
from unbroken.train.optim import AdamW
from unbroken.update.fused_adamw import AdamWCoefficients, fused_adamw_, fused_available
from unbroken.update.geometry import ChunkRef, StateGeometry

__all__ = ["ChunkStep"]

Ranges = Sequence[tuple[int, int]]
Mask = torch.Tensor | bool
"""Per-element mask of a chunk, or True / False when it holds for all of it / none of it."""


def _ranges_mask(idx: torch.Tensor, ranges: Ranges) -> Mask:
    """Which of the flat indices `idx` fall in the sorted, disjoint `ranges`."""
    if not ranges:
        return False
    starts = torch.tensor([a for a, _ in ranges], dtype=torch.int64)
    ends = torch.tensor([b for _, b in ranges], dtype=torch.int64)
    k = torch.searchsorted(starts, idx, right=True) - 1
    mask = (k >= 0) & (idx < ends[k.clamp(min=0)])
    if bool(mask.all()):
        return True
    if not bool(mask.any()):
        return False
    return mask


class ChunkStep:
    """Applies AdamW to one chunk of the striped state: weight decay only on elements in
    `decay` ranges, no change at all to elements in `frozen` ranges. On a CUDA device a chunk
    whose elements all decay or all do not, with nothing frozen, is one fused kernel launch
    (`unbroken.update.fused_adamw`); otherwise, and on the CPU, the eager reference.

    Args:
        geometry: the state's chunks.
        optimizer: the AdamW rule.
        decay: sorted, disjoint element ranges [a, b) with weight decay.
        frozen: sorted, disjoint element ranges [a, b) never updated (parameters and moments
            stay as they are).
    """

    def __init__(
        self,
        geometry: StateGeometry,
        optimizer: AdamW,
        decay: Ranges,
        frozen: Ranges = (),
    ) -> None:
        self.geometry = geometry
        self.optimizer = optimizer
        self.decay = tuple(decay)
        self.frozen = tuple(frozen)
        self._masks: dict[tuple[int, int], tuple[Mask, Mask]] = {}

    @classmethod
    def for_layout(cls, geometry: StateGeometry, optimizer: AdamW, layout: FlatLayout) -> ChunkStep:
        """The step for `layout`'s decay and frozen ranges."""
        return cls(geometry, optimizer, layout.decay_ranges(), layout.frozen_ranges())

    @property
    def decay_end(self) -> int | None:
        """The one boundary below which every element decays, when the decay ranges are one
        prefix [0, end) (or none) and nothing is frozen; else None (per-element masks)."""
        if self.frozen:
            return None
        if not self.decay:
            return 0
        if len(self.decay) == 1 and self.decay[0][0] == 0:
            return self.decay[0][1]
        return None

    def _chunk_masks(self, ref: ChunkRef) -> tuple[Mask, Mask]:
        key = (ref.group, ref.chunk)
        masks = self._masks.get(key)
        if masks is None:
            idx = self.geometry.element_index(ref)
            masks = self._masks[key] = (
                _ranges_mask(idx, self.decay),
                _ranges_mask(idx, self.frozen),
            )
        return masks

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
        decay, frozen = self._chunk_masks(ref)
        if frozen is True:
            return
        p = g.chunk_view(params, ref)
        m, v = g.chunk_view(exp_avg, ref), g.chunk_view(exp_avg_sq, ref)
        if p.is_cuda and frozen is False and isinstance(decay, bool) and fused_available():
            # One launch per chunk (see fused_adamw): decay_end below or above every element.
            coeffs = AdamWCoefficients.of(self.optimizer, step=step, lr=lr, grad_scale=grad_scale)
            first = ref.group * g.stripe_pages * g.elems_per_page + ref.byte_lo // 4
            end = g.padded_numel if decay else 0
            fused_adamw_(
                p, g.chunk_view(grads, ref), m, v, coeffs, first_index=first, decay_end=end
            )
            return
        kept = None
        if isinstance(frozen, torch.Tensor):
            frozen = frozen.to(p.device)
            kept = [t[frozen] for t in (p, m, v)]
        if isinstance(decay, torch.Tensor):
            factor = torch.where(decay.to(p.device), 1.0 - lr * self.optimizer.weight_decay, 1.0)
            p.mul_(factor.to(p.dtype))
            decay = False
        self.optimizer.update_range(
            p,
            g.chunk_view(grads, ref),
            m,
            v,
            step=step,
            lr=lr,
            grad_scale=grad_scale,
            decay=decay,
        )
        if kept is not None:
            for t, old in zip((p, m, v), kept, strict=True):
                t[frozen] = old
