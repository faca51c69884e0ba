"""The retained layout: one owner of every fact about how a rank's retained memory is cut.

`RetainedLayout` is computed once from the state's `StateGeometry` and the protection config,
and every consumer asks it — the state manager's regions (`regions()`), the resumable updater's
views and protection groups (`rmu`), failure localization and page-loss injection (which page
of which region belongs to which protection group), and the shadow's codec warm-up (the
groups' erasure geometries). Nothing else computes a region size, a parity width or a
page → group mapping.

Regions, by stable name:

    model         parameters | exp_avg | exp_avg_sq, each `padded_numel` fp32 (protected)
    grads         gradients, `padded_numel` fp32 (protected)
    model_parity  per group: H1 first-tier then H2 second-tier pages
    grad_parity   the same for the gradient groups
    marker        page 0: the progress marker; page 1: its first tier; page 2: its second tier
    undo          the current chunk's pre-update bytes, D x chunk_bytes (process buffer)
    scratch       two slots of a chunk's new parity range, 2 x (H1 + H2) x chunk_bytes (process
                  buffer): transaction k stages into slot k % 2, so on a GPU with parity in host
                  memory the write-back of transaction k can run beside transaction k + 1

Protection group i of the model holds the d stripe pages of group i of each of the three
segments (D = 3·d data pages; see [Note: chunk-geometry] in `unbroken.update.geometry`);
gradient group i holds the d gradient pages of stripe i.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from unbroken.config import ProtectionConfig
from unbroken.erasure import ErasureGeometry
from unbroken.update.geometry import StateGeometry

__all__ = ["MARKER_PAGE", "SCRATCH_SLOTS", "SEGMENTS", "GroupKind", "RegionSpec", "RetainedLayout"]

MARKER_PAGE = 4096
"""Bytes of one marker page (the marker region is three of them)."""

SEGMENTS = 3
"""Segments of the `model` region: parameters, exp_avg, exp_avg_sq."""

SCRATCH_SLOTS = 2
"""Staging slots of the `scratch` region (transaction k uses slot k % SCRATCH_SLOTS)."""

GroupKind = Literal["model", "grads"]


@dataclass(frozen=True, slots=True)
class RegionSpec:
    name: str
    nbytes: int
    page_bytes: int
    protected: bool
    """Protected regions hold state that must survive (parity covers the data regions);
    unprotected ones are per-process buffers the updater may need after a crash."""


@dataclass(frozen=True, slots=True)
class RetainedLayout:
    """Region sizes, protection groups and the page → group mapping of one rank's state.

    Args:
        geometry: pages, stripes and chunks of the flat state.
        parity_pages: H1, first-tier parity pages per group.
        second_tier_pages: H2, second-tier parity pages (over the first tier) per group.
        generator: the first tier's generator matrix (`ErasureGeometry.generator`).
    """

    geometry: StateGeometry
    parity_pages: int
    second_tier_pages: int
    generator: str = "cauchy"

    def __post_init__(self) -> None:
        if self.parity_pages < 1 or self.second_tier_pages < 0:
            raise ValueError(
                f"retained layout: parity_pages >= 1 and second_tier_pages >= 0, got "
                f"{self.parity_pages} and {self.second_tier_pages}"
            )

    @classmethod
    def of(cls, geometry: StateGeometry, prot: ProtectionConfig) -> RetainedLayout:
        """`prot`'s layout (its tiers as `tiers_of` reads them)."""
        prot = cls.tiers_of(prot)
        return cls(geometry, prot.parity_pages, prot.second_tier_pages, prot.code)

    @staticmethod
    def tiers_of(prot: ProtectionConfig) -> ProtectionConfig:
        """`prot` with its first tier set: a config not `resolved` for its device yet (jobs
        carry resolved ones, `unbroken.api`) takes the CPU's (four Cauchy pages unless set)."""
        if prot.parity_pages is None or prot.code == "auto":
            return prot.resolved(cuda=False)
        return prot

    # -- sizes ----------------------------------------------------------------------------
    @property
    def page_bytes(self) -> int:
        return self.geometry.page_bytes

    @property
    def groups(self) -> int:
        return self.geometry.groups

    @property
    def stripe(self) -> int:
        """d: pages of each segment in one group."""
        return self.geometry.stripe_pages

    @property
    def width(self) -> int:
        """Parity pages per group, both tiers (H1 + H2)."""
        return self.parity_pages + self.second_tier_pages

    def data_pages(self, kind: GroupKind) -> int:
        """D of one group: 3·d for the model, d for the gradients."""
        return SEGMENTS * self.stripe if kind == "model" else self.stripe

    def erasure(self, kind: GroupKind) -> ErasureGeometry:
        """The erasure geometry of one model or gradient protection group."""
        return ErasureGeometry(
            page_bytes=self.page_bytes,
            data_pages=self.data_pages(kind),
            parity_pages=self.parity_pages,
            second_tier_pages=self.second_tier_pages,
            generator=self.generator,
        )

    def regions(self) -> list[RegionSpec]:
        """Every retained region, in allocation order."""
        g, s = self.geometry, self.page_bytes
        segment = g.segment_pages * s
        parity = self.groups * self.width * s
        return [
            RegionSpec("model", SEGMENTS * segment, s, True),
            RegionSpec("grads", segment, s, True),
            RegionSpec("model_parity", parity, s, True),
            RegionSpec("grad_parity", parity, s, True),
            RegionSpec("marker", 3 * MARKER_PAGE, MARKER_PAGE, True),
            RegionSpec("undo", self.data_pages("model") * g.chunk_bytes, MARKER_PAGE, False),
            RegionSpec("scratch", SCRATCH_SLOTS * self.width * g.chunk_bytes, MARKER_PAGE, False),
        ]

    @staticmethod
    def host_regions(prot: ProtectionConfig) -> frozenset[str]:
        """Regions kept in host memory when the state trains on a GPU: the marker always, the
        model's parity (both tiers) unless `prot.parity_memory` is "device" (Leto §4)."""
        if prot.parity_memory == "host":
            return frozenset({"marker", "model_parity"})
        return frozenset({"marker"})

    # -- page <-> group -------------------------------------------------------------------
    def group_rows(self, kind: GroupKind, group: int) -> list[int]:
        """Pages (indices in the `model` or `grads` region) of one group's data, in the
        group's data-page order."""
        d, seg = self.stripe, self.geometry.segment_pages
        segments = SEGMENTS if kind == "model" else 1
        return [sg * seg + group * d + p for sg in range(segments) for p in range(d)]

    def parity_rows(self, group: int, tier: int = 1) -> list[int]:
        """Pages (indices in `model_parity` / `grad_parity`) of one group's first (tier 1) or
        second (tier 2) parity tier."""
        base = group * self.width
        if tier == 1:
            return [base + r for r in range(self.parity_pages)]
        return [base + self.parity_pages + r for r in range(self.second_tier_pages)]

    def lost_by_group(
        self, kind: GroupKind, data_lost: list[int], parity_lost: list[int]
    ) -> dict[int, set[int]]:
        """Lost pages of a region and its parity region → {group: positions in the group's
        pages (data first, then first tier, then second tier)}. Pages past the protected
        segments (a gradient-sized view of the model region) are not in any group."""
        d, seg = self.stripe, self.geometry.segment_pages
        segments = SEGMENTS if kind == "model" else 1
        out: dict[int, set[int]] = {}
        for page in data_lost:
            sg, p = divmod(page, seg)
            if sg >= segments:
                continue
            group, pos = divmod(p, d)
            out.setdefault(group, set()).add(sg * d + pos)
        for page in parity_lost:
            group, r = divmod(page, self.width)
            if group < self.groups:
                out.setdefault(group, set()).add(segments * d + r)
        return out
