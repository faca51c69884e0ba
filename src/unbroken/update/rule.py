"""The optimizer-rule protocol: what an optimizer must be to run under the updaters.

An optimizer is a `ChunkRule`: a per-chunk step over views of the flat state, run by
`unbroken.update.kernel.ChunkStep` for the plain updater and inside the crash-consistent chunk
transactions of the resumable one (`unbroken.update.rmu`). The contract (docs/optimizers.md):

- **State slots.** A rule declares its per-element state as named `slots` (at most
  `MAX_SLOTS`); slot i lives in the retained `model` region's segment i + 1 (`exp_avg`, then
  `exp_avg_sq`), protected by the same parity as the parameters. Unused slots stay zero.
- **Pure chunk step.** `apply(pass_, p, g, slots, ctx)` writes new values into the chunk's
  parameter and slot views in place, computed only from their old values, the gradient view
  (never written), the scalars in `ctx` and `ctx.derived`. So a chunk interrupted mid-write and
  restored from its undo copy computes the same bits when redone (Leto §5.2): the transaction
  is idempotent.
- **Passes.** Element-wise rules have one pass. A rule that needs a whole-matrix quantity
  (Muon's orthogonalized momentum) runs several passes of the same chunks; before each pass,
  `derive` may compute a process-local buffer from retained state that no chunk of that pass
  writes — so a resumed pass (a replacement process included) derives the same buffer again.
- **Element classes.** `ranges()` names sorted, disjoint flat element ranges (e.g. Muon's
  matrices); `ChunkStep` turns each into a per-chunk `Mask` in `ctx.masks`, alongside weight
  decay (`ctx.decay`) and frozen elements (handled by `ChunkStep`: never changed).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from unbroken.train.state import TrainState
from unbroken.update.geometry import ChunkRef

__all__ = ["MAX_SLOTS", "ChunkContext", "ChunkRule", "Mask", "Ranges", "select_apply"]

MAX_SLOTS = 2
"""State slots per element the retained layout holds (the `model` region's segments 2 and 3)."""

Ranges = Sequence[tuple[int, int]]
Mask = torch.Tensor | bool
"""Per-element mask of a chunk, or True / False when it holds for all of it / none of it."""


@dataclass(frozen=True, slots=True)
class ChunkContext:
    """Everything besides the views that one chunk's step may read."""

    ref: ChunkRef
    step: int
    """1-based optimizer step (the iteration + 1)."""
    lr: float
    grad_scale: float
    """Clipping coefficient applied to the gradient inside the step (1.0 = none)."""
    decay: Mask
    """Elements with weight decay."""
    frozen: Mask
    """Elements never updated (`ChunkStep` restores them after `apply`; rules may ignore it)."""
    first_index: int
    """Flat element index of the views' element [0, 0]."""
    masks: Mapping[str, Mask] = field(default_factory=dict)
    """The rule's `ranges()` as masks of this chunk."""
    derived: torch.Tensor | None = None
    """This pass's derived buffer, viewed like the chunk (None when the rule derives none)."""
    decay_end: int | None = None
    """When the decay ranges are one prefix [0, end) and nothing is frozen: that end (flat
    elements below it decay), else None. A fused kernel decides decay per element from it, so
    a chunk across the boundary computes the bits of the whole-state launch."""

    def scaled(self, g: torch.Tensor) -> torch.Tensor:
        """The clipped gradient (a new tensor when clipping applies; `g` is never written)."""
        return g if self.grad_scale == 1.0 else g * self.grad_scale


class ChunkRule(Protocol):
    """An optimizer under the updaters (see the module docstring for the contract)."""

    name: str
    slots: tuple[str, ...]
    """Names of the per-element state slots, in segment order (at most `MAX_SLOTS`)."""
    passes: int
    """Passes over all chunks per update (1 for element-wise rules)."""

    def ranges(self) -> Mapping[str, Ranges]:
        """Named element classes the rule distinguishes (sorted, disjoint ranges each)."""
        ...

    def derive(
        self, pass_: int, state: TrainState, *, step: int, lr: float, grad_scale: float
    ) -> torch.Tensor | None:
        """A flat buffer (the state's padded length) computed before pass `pass_` from retained
        state that no chunk of the pass writes; None if the pass needs none."""
        ...

    def apply(
        self,
        pass_: int,
        p: torch.Tensor,
        g: torch.Tensor,
        slots: tuple[torch.Tensor, ...],
        ctx: ChunkContext,
    ) -> None:
        """Write the chunk's new parameters and slots into `p` and `slots` (in place) from
        their old values, `g` and `ctx` only."""
        ...


def select_apply(
    mask: Mask,
    views: tuple[torch.Tensor, ...],
    inside,
    outside,
) -> None:
    """Run `inside(views)` on the elements where `mask` holds and `outside(views)` elsewhere,
    both in place: a whole-chunk mask calls one of them on the views; a mixed one runs
    `outside` on the whole chunk, then `inside` on 1-D gathers of the old values of the masked
    elements (so each element's result is computed from its own old values), scattered back.

    Args:
        views: the chunk's views (parameters, gradient, slots), all of one shape; `inside`
            and `outside` take them in this order and may write any but the gradient (index 1).
    """
    if mask is True:
        inside(views)
        return
    if mask is False:
        outside(views)
        return
    mask = mask.to(views[0].device)
    old = tuple(t[mask] for t in views)
    outside(views)
    inside(old)
    for i, (t, new) in enumerate(zip(views, old, strict=True)):
        if i != 1:  # the gradient is read, never written
            t[mask] = new
