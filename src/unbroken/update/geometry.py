"""How the flat training state is cut into pages, protection groups and update chunks.

The model state is three flat fp32 segments of equal padded length — parameters, exp_avg,
exp_avg_sq — each a whole number of pages of S bytes. Protection group i holds the same d
consecutive "stripe" pages of each segment (D = 3·d data pages), so one element's parameter and
both moments are always in the same group. A chunk is one byte range [x, x+c) of every page of
a group: updating it touches only the elements of that range, and its parity delta touches only
parity bytes [x, x+c) (the codec's byte-range update). Gradients use the same stripes: gradient
group i is the d gradient pages of stripe i.

[Note: chunk-geometry] Every updater (plain or transactional) iterates the same chunks in the
same order with the same kernel, so a run with protection and one without compute bit-identical
states — protection only adds the undo, parity and marker work around each chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["ChunkRef", "StateGeometry"]

_F32 = 4


@dataclass(frozen=True, slots=True)
class ChunkRef:
    group: int
    chunk: int
    byte_lo: int
    byte_hi: int


@dataclass(frozen=True, slots=True)
class StateGeometry:
    """Pages, groups and chunks of a flat state of `numel` fp32 elements.

    Args:
        numel: elements of the model (parameters) — the moments and gradients have as many.
        page_bytes: page size S.
        stripe_pages: pages of each segment per group (d); a group has D = 3·d data pages.
        chunk_bytes: bytes per page per chunk (c); must divide page_bytes.
    """

    numel: int
    page_bytes: int
    stripe_pages: int
    chunk_bytes: int

    def __post_init__(self) -> None:
        if self.page_bytes % _F32 or self.page_bytes <= 0:
            raise ValueError("page_bytes must be a positive multiple of 4")
        if self.chunk_bytes <= 0 or self.page_bytes % self.chunk_bytes or self.chunk_bytes % _F32:
            raise ValueError(
                f"chunk_bytes={self.chunk_bytes} must be a multiple of 4 dividing "
                f"page_bytes={self.page_bytes}"
            )
        if self.stripe_pages < 1:
            raise ValueError("stripe_pages must be at least 1")

    @property
    def elems_per_page(self) -> int:
        return self.page_bytes // _F32

    @property
    def groups(self) -> int:
        pages = -(-self.numel // self.elems_per_page)
        return max(1, -(-pages // self.stripe_pages))

    @property
    def segment_pages(self) -> int:
        return self.groups * self.stripe_pages

    @property
    def padded_numel(self) -> int:
        """Elements of each padded segment (parameters, each moment, gradients)."""
        return self.segment_pages * self.elems_per_page

    @property
    def chunks_per_group(self) -> int:
        return self.page_bytes // self.chunk_bytes

    def chunks(self) -> list[ChunkRef]:
        c = self.chunk_bytes
        return [
            ChunkRef(g, j, j * c, (j + 1) * c)
            for g in range(self.groups)
            for j in range(self.chunks_per_group)
        ]

    def chunk_view(self, segment: torch.Tensor, ref: ChunkRef) -> torch.Tensor:
        """[d, c/4] strided fp32 view of one segment's elements in chunk `ref`."""
        rows = segment.view(self.segment_pages, self.elems_per_page)
        d = self.stripe_pages
        return rows[ref.group * d : (ref.group + 1) * d, ref.byte_lo // _F32 : ref.byte_hi // _F32]

    def row_intervals(self, ref: ChunkRef) -> list[tuple[int, int]]:
        """The flat element indices [lo, hi) of each row of chunk `ref`'s `chunk_view` (a
        stripe page's slice: row r holds elements lo..hi-1 of the flat state)."""
        d, e = self.stripe_pages, self.elems_per_page
        lo, hi = ref.byte_lo // _F32, ref.byte_hi // _F32
        return [(r * e + lo, r * e + hi) for r in range(ref.group * d, (ref.group + 1) * d)]

    def group_pages(self, segment: torch.Tensor, group: int) -> list[torch.Tensor]:
        """The d uint8 pages of `segment` in `group` (views)."""
        raw = segment.view(torch.uint8).view(self.segment_pages, self.page_bytes)
        d = self.stripe_pages
        return [raw[p] for p in range(group * d, (group + 1) * d)]
