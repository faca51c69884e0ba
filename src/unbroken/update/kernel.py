"""The per-chunk optimizer step shared by every updater (see [Note: chunk-geometry]).

`ChunkStep` runs the job's `ChunkRule` (`unbroken.update.rule`: AdamW, SGD, Lion, Muon) on one
chunk: it cuts the chunk's views out of the flat buffers, builds the chunk's masks, keeps frozen
elements unchanged, and holds the pass's derived buffer (`begin_pass`).

Which elements of a chunk get weight decay and which are frozen comes from element ranges of
the flat layout (`FlatLayout.decay_ranges`, `frozen_ranges`; [Note: shared parameters] in
`unbroken.model.flat`), turned into one mask per chunk on first use. A chunk entirely inside
(or outside) a range takes the scalar path, so the common layouts (matrices first, vectors
after) compute exactly what a single decay boundary did.
"""

from __future__ import annotations

import bisect

import torch

from unbroken.config import TrainConfig
from unbroken.model.flat import FlatLayout
from unbroken.train.optim import AdamW
from unbroken.train.state import TrainState
from unbroken.update.adamw import AdamWRule
from unbroken.update.geometry import ChunkRef, StateGeometry
from unbroken.update.optimizers import rule_for
from unbroken.update.rule import ChunkContext, ChunkRule, Mask, Ranges

__all__ = ["ChunkStep"]


def _ranges_mask(rows: list[tuple[int, int]], ranges: Ranges) -> Mask:
    """Which elements of a chunk fall in the sorted, disjoint `ranges`; the chunk's row r holds
    the flat indices [lo, hi) of `rows[r]` (`StateGeometry.row_intervals`). True / False when
    all / none do, else a CPU bool mask shaped like the chunk's views.

    Interval arithmetic, not a per-element search: a promoted trainer builds the masks of every
    chunk its resumed update touches, and searching 16 M indices of a 2 MiB-page chunk on the
    host took 0.75 s per chunk (9 s of a 1b L3 recovery on the H200)."""
    if not ranges:
        return False
    ends = [b for _, b in ranges]
    pieces: list[tuple[int, int, int]] = []  # (row, first column, end column) inside a range
    for r, (lo, hi) in enumerate(rows):
        j = bisect.bisect_right(ends, lo)  # the first range ending after lo
        while j < len(ranges) and ranges[j][0] < hi:
            a, b = ranges[j]
            pieces.append((r, max(a, lo) - lo, min(b, hi) - lo))
            j += 1
    if not pieces:
        return False
    width = rows[0][1] - rows[0][0]
    if sum(e - s for _, s, e in pieces) == width * len(rows):
        return True
    mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for r, s, e in pieces:
        mask[r, s:e] = True
    return mask


class ChunkStep:
    """Applies the optimizer rule to one chunk of the striped state: weight decay only on
    elements in `decay` ranges, no change at all to elements in `frozen` ranges.

    Args:
        geometry: the state's chunks.
        optimizer: the rule (an `AdamW` is taken as `AdamWRule`).
        decay: sorted, disjoint element ranges [a, b) with weight decay.
        frozen: sorted, disjoint element ranges [a, b) never updated (parameters and state
            slots stay as they are).
    """

    def __init__(
        self,
        geometry: StateGeometry,
        optimizer: AdamW | ChunkRule,
        decay: Ranges,
        frozen: Ranges = (),
    ) -> None:
        self.geometry = geometry
        if isinstance(optimizer, AdamW):
            optimizer = AdamWRule(optimizer, geometry.padded_numel)
        self.rule: ChunkRule = optimizer
        self.decay = tuple(decay)
        self.frozen = tuple(frozen)
        self._rule_ranges = {k: tuple(v) for k, v in self.rule.ranges().items()}
        self._masks: dict[tuple[int, int], tuple[Mask, Mask, dict[str, Mask]]] = {}
        self._derived: dict[int, torch.Tensor | None] = {}

    @classmethod
    def for_layout(cls, geometry: StateGeometry, optimizer: AdamW, layout: FlatLayout) -> ChunkStep:
        """The AdamW step for `layout`'s decay and frozen ranges."""
        return cls(geometry, optimizer, layout.decay_ranges(), layout.frozen_ranges())

    @classmethod
    def for_job(cls, geometry: StateGeometry, cfg: TrainConfig, layout: FlatLayout) -> ChunkStep:
        """The step of `cfg.optimizer` for `layout`'s decay and frozen ranges."""
        rule = rule_for(cfg, layout, geometry)
        return cls(geometry, rule, layout.decay_ranges(), layout.frozen_ranges())

    @property
    def optimizer(self) -> AdamW | ChunkRule:
        """The AdamW of an AdamW step; the rule otherwise."""
        return self.rule.opt if isinstance(self.rule, AdamWRule) else self.rule

    @property
    def passes(self) -> int:
        return self.rule.passes

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

    def first_index(self, ref: ChunkRef) -> int:
        """Flat element index of element [0, 0] of chunk `ref`'s views."""
        g = self.geometry
        return ref.group * g.stripe_pages * g.elems_per_page + ref.byte_lo // 4

    @property
    def fused_adamw(self) -> bool:
        """Whether every chunk's step is the fused AdamW launch with one decay boundary (no
        masks, nothing frozen, one pass): what `GraphUpdater` captures."""
        return isinstance(self.rule, AdamWRule) and self.decay_end is not None

    def begin_pass(
        self, pass_: int, state: TrainState, *, step: int, lr: float, grad_scale: float
    ) -> None:
        """Derive pass `pass_`'s buffer from the retained state (before its first chunk, and
        again when a resumed update enters the pass)."""
        self._derived = {
            pass_: self.rule.derive(pass_, state, step=step, lr=lr, grad_scale=grad_scale)
        }

    def _chunk_masks(self, ref: ChunkRef) -> tuple[Mask, Mask, dict[str, Mask]]:
        key = (ref.group, ref.chunk)
        masks = self._masks.get(key)
        if masks is None:
            rows = self.geometry.row_intervals(ref)
            masks = self._masks[key] = (
                _ranges_mask(rows, self.decay),
                _ranges_mask(rows, self.frozen),
                {k: _ranges_mask(rows, r) for k, r in self._rule_ranges.items()},
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
        pass_: int = 0,
    ) -> None:
        g = self.geometry
        decay, frozen, masks = self._chunk_masks(ref)
        if frozen is True:
            return
        p = g.chunk_view(params, ref)
        slots = tuple(g.chunk_view(t, ref) for t in (exp_avg, exp_avg_sq)[: len(self.rule.slots)])
        if pass_ and pass_ not in self._derived:
            raise RuntimeError(f"pass {pass_} of {self.rule.name} before begin_pass")
        derived = self._derived.get(pass_)
        ctx = ChunkContext(
            ref=ref,
            step=step,
            lr=lr,
            grad_scale=grad_scale,
            decay=decay,
            frozen=frozen,
            first_index=self.first_index(ref),
            masks=masks,
            derived=None if derived is None else g.chunk_view(derived, ref),
            decay_end=self.decay_end,
        )
        kept = None
        if isinstance(frozen, torch.Tensor):
            frozen = frozen.to(p.device)
            kept = [t[frozen] for t in (p, *slots)]
        self.rule.apply(pass_, p, g.chunk_view(grads, ref), slots, ctx)
        if kept is not None:
            for t, old in zip((p, *slots), kept, strict=True):
                t[frozen] = old
