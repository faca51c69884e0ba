"""The shape of a protection group: page size and the number of data and parity pages per tier.

`ErasureGeometry` is validated when it is built, so a group that the code cannot protect never
gets allocated. Page numbering used everywhere in this package (and by its callers):

    data pages          0 .. D-1
    first-tier parity   D .. D+H1-1           (protects the data pages)
    second-tier parity  D+H1 .. D+H1+H2-1     (protects the first-tier parity pages)
"""

from __future__ import annotations

from dataclasses import dataclass

from unbroken.erasure.errors import GeometryError
from unbroken.erasure.gf256 import GENERATORS

__all__ = ["ErasureGeometry"]

_MIB = 1 << 20


@dataclass(frozen=True, kw_only=True, slots=True)
class ErasureGeometry:
    """Geometry of a two-tier protection group over GF(2^8).

    The defaults (2 MiB pages, D=240, H1=16, H2=1) give a 480 MiB group that survives any 16 lost
    pages among data and first-tier parity, plus one lost first-tier page repaired from the
    second tier.
    """

    page_bytes: int = 2 * _MIB
    """Bytes per page (S). A positive multiple of 64, so vector kernels never split a page."""
    data_pages: int = 240
    """Data pages per group (D)."""
    parity_pages: int = 16
    """First-tier parity pages per group (H1): the number of lost pages the group tolerates."""
    second_tier_pages: int = 1
    """Second-tier parity pages (H2) over the H1 first-tier pages; 0 disables the second tier."""
    generator: str = "cauchy"
    """The first tier's generator matrix (`gf256.GENERATORS`): ``cauchy``, or ``vandermonde``
    for H1 ≤ 3 (MDS only there; the GPU's fused update computes it by Horner's rule). The
    second tier is always Cauchy."""

    def __post_init__(self) -> None:
        for name in ("page_bytes", "data_pages", "parity_pages", "second_tier_pages"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise GeometryError(f"erasure geometry: {name} must be an int, got {value!r}")
        if self.page_bytes <= 0 or self.page_bytes % 64:
            raise GeometryError(
                f"erasure geometry: page_bytes must be a positive multiple of 64, "
                f"got {self.page_bytes}"
            )
        if self.data_pages < 1:
            raise GeometryError(f"erasure geometry: data_pages must be ≥ 1, got {self.data_pages}")
        if self.parity_pages < 1:
            raise GeometryError(
                f"erasure geometry: parity_pages must be ≥ 1, got {self.parity_pages}"
            )
        if self.data_pages + self.parity_pages > 256:
            raise GeometryError(
                "erasure geometry: GF(2^8) allows data_pages + parity_pages ≤ 256, got "
                f"{self.data_pages} + {self.parity_pages} = {self.data_pages + self.parity_pages}"
            )
        if self.generator not in GENERATORS:
            raise GeometryError(
                f"erasure geometry: generator must be one of {GENERATORS}, got {self.generator!r}"
            )
        if self.generator == "vandermonde" and self.parity_pages > 3:
            raise GeometryError(
                "erasure geometry: the Vandermonde first tier is MDS for at most 3 parity pages, "
                f"got {self.parity_pages} (use generator 'cauchy')"
            )
        if self.second_tier_pages < 0:
            raise GeometryError(
                f"erasure geometry: second_tier_pages must be ≥ 0, got {self.second_tier_pages}"
            )
        if self.parity_pages + self.second_tier_pages > 256:
            raise GeometryError(
                "erasure geometry: GF(2^8) allows parity_pages + second_tier_pages ≤ 256, got "
                f"{self.parity_pages} + {self.second_tier_pages}"
            )

    @property
    def total_pages(self) -> int:
        """All pages of the group: data, first tier and second tier."""
        return self.data_pages + self.parity_pages + self.second_tier_pages

    @property
    def group_bytes(self) -> int:
        """Bytes of data protected by one group (D × S)."""
        return self.data_pages * self.page_bytes

    @property
    def first_tier(self) -> range:
        """Indices of the first-tier parity pages."""
        return range(self.data_pages, self.data_pages + self.parity_pages)

    @property
    def second_tier(self) -> range:
        """Indices of the second-tier parity pages."""
        start = self.data_pages + self.parity_pages
        return range(start, start + self.second_tier_pages)
