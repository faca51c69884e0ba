"""Muon (Newton–Schulz orthogonalized momentum per weight matrix) as a two-pass `ChunkRule`.

Muon's update of a matrix is a function of the whole matrix's new momentum, so no chunk of the
striped geometry can compute its elements alone. The rule splits the update into two passes of
ordinary chunk transactions, each idempotent on its own (see `unbroken.update.rule`):

    pass 0 (element-wise): momentum  B ← lerp(B, g, 1 − μ)           (slot exp_avg)
                           direction U ← lerp(g, B, μ) if nesterov else B   (slot exp_avg_sq)
                           every non-Muon element: one AdamW step (both slots)
    derive before pass 1:  O = NS(U) per matrix, from the retained U (pass 1 never writes U)
    pass 1 (element-wise given O): θ ← θ·(1 − lr·wd) − lr·adjust(A, B)·O   (Muon elements only)

A crash in pass 0 redoes a chunk from its undo copy like any element-wise rule; a crash in pass
1 (even in a replacement process) derives the same O from the retained, parity-protected U and
finishes the remaining chunks. The arithmetic per matrix is `torch.optim.Muon`'s (bf16
Newton–Schulz with its coefficients, lerp momentum, the same lr adjustment), so a chunked update
equals torch's bit for bit on the same device. Parameters that are not 2-D, frozen ones and
matrices matched by `train.muon_adamw` (embeddings, the output head) take AdamW in pass 0.

After the update the exp_avg_sq slot of a Muon matrix holds that iteration's direction U (state
like any other: hashed, checkpointed, protected).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from unbroken.model.flat import FlatLayout, matches_any
from unbroken.train.optim import AdamW
from unbroken.train.state import TrainState
from unbroken.update.adamw import adamw_chunk
from unbroken.update.geometry import ChunkRef, StateGeometry
from unbroken.update.rule import ChunkContext, Ranges, select_apply

__all__ = ["MuonMatrix", "MuonRule", "muon_matrices", "newton_schulz"]

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
"""The quintic Newton–Schulz coefficients of Keller Jordan's Muon (torch.optim.Muon's)."""
NS_EPS = 1e-7


def newton_schulz(u: torch.Tensor, steps: int, eps: float = NS_EPS) -> torch.Tensor:
    """The approximately orthogonalized `u` (2-D), in bf16, as torch.optim.Muon computes it."""
    a, b, c = NS_COEFFICIENTS
    x = u.bfloat16()
    tall = u.size(0) > u.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    return x.T if tall else x


@dataclass(frozen=True, slots=True)
class MuonMatrix:
    """One matrix Muon updates: its flat span, shape and scalars."""

    offset: int
    rows: int
    cols: int
    decay: bool
    lr_ratio: float
    """The learning-rate adjustment of its shape."""

    @property
    def end(self) -> int:
        return self.offset + self.rows * self.cols


def _lr_ratio(rows: int, cols: int, how: str) -> float:
    if how == "original":
        return math.sqrt(max(1, rows / cols))
    return 0.2 * math.sqrt(max(rows, cols))


def muon_matrices(layout: FlatLayout, adamw_patterns: Sequence[str], adjust: str):
    """The trainable 2-D parameters of `layout` not matched by `adamw_patterns`, by offset."""
    out = [
        MuonMatrix(s.offset, s.shape[0], s.shape[1], s.decay, _lr_ratio(*s.shape, adjust))
        for s in layout.stored
        if s.trainable and len(s.shape) == 2 and not matches_any(s.names, adamw_patterns)
    ]
    return tuple(sorted(out, key=lambda m: m.offset))


Piece = tuple[int, int, int, MuonMatrix]
"""(row, first column, end column) of a chunk view inside one matrix."""


class MuonRule:
    """Muon for the matrices, AdamW for everything else (slots: exp_avg, exp_avg_sq)."""

    name = "muon"
    slots = ("exp_avg", "exp_avg_sq")
    passes = 2

    def __init__(
        self,
        adamw: AdamW,
        matrices: tuple[MuonMatrix, ...],
        geometry: StateGeometry,
        *,
        momentum: float,
        nesterov: bool,
        ns_steps: int,
        weight_decay: float,
    ) -> None:
        self.adamw = adamw
        self.matrices = matrices
        self.geometry = geometry
        self.momentum = momentum
        self.nesterov = nesterov
        self.ns_steps = ns_steps
        self.weight_decay = weight_decay
        self._starts = [m.offset for m in matrices]
        self._pieces: dict[tuple[int, int], list[Piece]] = {}

    def ranges(self) -> Mapping[str, Ranges]:
        return {"muon": [(m.offset, m.end) for m in self.matrices]}

    def derive(
        self, pass_: int, state: TrainState, *, step: int, lr: float, grad_scale: float
    ) -> torch.Tensor | None:
        if pass_ == 0:
            return None
        out = torch.zeros_like(state.params)
        for m in self.matrices:
            u = state.exp_avg_sq[m.offset : m.end].view(m.rows, m.cols)
            out[m.offset : m.end].view(m.rows, m.cols).copy_(newton_schulz(u, self.ns_steps))
        return out

    def apply(self, pass_: int, p, g, slots, ctx: ChunkContext) -> None:
        if pass_ == 0:
            select_apply(
                ctx.masks["muon"],
                (p, g, *slots),
                self._momentum(ctx),
                lambda views: adamw_chunk(self.adamw, *views, ctx),
            )
            return
        o = ctx.derived
        assert o is not None, "Muon's second pass needs its derived buffer"
        for r, lo, hi, m in self._chunk_pieces(ctx.ref, ctx.first_index):
            row = p[r, lo:hi]
            if m.decay and self.weight_decay:
                row.mul_(1.0 - ctx.lr * self.weight_decay)
            row.add_(o[r, lo:hi], alpha=-(ctx.lr * m.lr_ratio))

    def _momentum(self, ctx: ChunkContext):
        mu = self.momentum

        def step(views: tuple[torch.Tensor, ...]) -> None:
            _, g, buf, direction = views
            grad = ctx.scaled(g)
            buf.lerp_(grad, 1 - mu)
            direction.copy_(grad.lerp(buf, mu) if self.nesterov else buf)

        return step

    def _chunk_pieces(self, ref: ChunkRef, first: int) -> list[Piece]:
        """The row segments of chunk `ref`'s views that lie in Muon matrices (cached)."""
        key = (ref.group, ref.chunk)
        pieces = self._pieces.get(key)
        if pieces is None:
            g = self.geometry
            cols, epp = (ref.byte_hi - ref.byte_lo) // 4, g.elems_per_page
            pieces = []
            for r in range(g.stripe_pages):
                lo, hi = first + r * epp, first + r * epp + cols
                k = max(0, bisect.bisect_right(self._starts, lo) - 1)
                while k < len(self.matrices) and self.matrices[k].offset < hi:
                    m = self.matrices[k]
                    a, b = max(lo, m.offset), min(hi, m.end)
                    if a < b:
                        pieces.append((r, a - lo, b - lo, m))
                    k += 1
            self._pieces[key] = pieces
        return pieces
