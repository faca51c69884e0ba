"""The retained regions the resumable updater needs, by stable name and size.

model         parameters | exp_avg | exp_avg_sq, each `padded_numel` fp32 (protected)
grads         gradients, `padded_numel` fp32 (protected)
model_parity  per group: H1 first-tier then H2 second-tier pages
grad_parity   the same for the gradient groups
marker        page 0: the progress marker; page 1: its first tier; page 2: its second tier
undo          the current chunk's pre-update bytes, D x chunk_bytes (process buffer)
scratch       the current chunk's new parity range, (H1 + H2) x chunk_bytes (process buffer)
"""

from __future__ import annotations

from dataclasses import dataclass

from unbroken.config import ProtectionConfig
from unbroken.update.geometry import StateGeometry

__all__ = ["MARKER_PAGE", "RegionSpec", "region_specs"]

MARKER_PAGE = 4096


@dataclass(frozen=True, slots=True)
class RegionSpec:
    name: str
    nbytes: int
    page_bytes: int
    protected: bool


def region_specs(geometry: StateGeometry, prot: ProtectionConfig) -> list[RegionSpec]:
    s, g = geometry.page_bytes, geometry
    seg = g.segment_pages * s
    parity = g.groups * (prot.parity_pages + prot.second_tier_pages) * s
    d_pages = 3 * g.stripe_pages
    return [
        RegionSpec("model", 3 * seg, s, True),
        RegionSpec("grads", seg, s, True),
        RegionSpec("model_parity", parity, s, True),
        RegionSpec("grad_parity", parity, s, True),
        RegionSpec("marker", 3 * MARKER_PAGE, MARKER_PAGE, True),
        RegionSpec("undo", d_pages * g.chunk_bytes, MARKER_PAGE, False),
        RegionSpec(
            "scratch",
            (prot.parity_pages + prot.second_tier_pages) * g.chunk_bytes,
            MARKER_PAGE,
            False,
        ),
    ]
