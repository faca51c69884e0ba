"""A protection group: D data pages, H1 first-tier parity pages over them, and H2 second-tier
parity pages over the first tier — the unit the state manager allocates and the updater and
recovery work on (Leto §4.1, §5.2).

The group resolves its pages once (`PageTable`), so per-chunk updates cost no per-page Python
work. It owns the order of repair (Leto §4.2): a lost first-tier page is rebuilt from the second
tier first, so that as much first-tier parity as possible is available for the data pages; a
first-tier page the second tier cannot repair is rebuilt from the data afterwards. Feasibility is
decided before anything is written, so an unrecoverable loss leaves every page untouched.

All pages of a group live on one device. When data sits in GPU memory and parity in host memory
(the Leto layout), the updater stages the parity to the GPU for the update phase and back at the
boundary (Pseudocode 1, lines 6 and 12) and builds the group over the staged copy.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from unbroken.erasure._buffers import PageTable
from unbroken.erasure.backends import get_codec
from unbroken.erasure.codec import Codec, PageDeltas, Pages
from unbroken.erasure.errors import UnrecoverableError
from unbroken.erasure.geometry import ErasureGeometry

__all__ = ["ProtectionGroup"]


def _as_table(pages: Pages) -> PageTable:
    return pages if isinstance(pages, PageTable) else PageTable(pages)


class ProtectionGroup:
    """Two-tier Reed–Solomon protection of one group of pages.

    Args:
        geometry: page size and page counts.
        data: the D data pages.
        first_tier: the H1 first-tier parity pages.
        second_tier: the H2 second-tier parity pages (empty if H2 = 0).
        name: names the group in errors and logs.
        backend: codec backend (``auto`` picks the fastest for the pages' device).

    Raises:
        ValueError: page counts or sizes that disagree with the geometry, or pages on several
            devices.
    """

    def __init__(
        self,
        geometry: ErasureGeometry,
        data: Pages,
        first_tier: Pages,
        second_tier: Pages = (),
        *,
        name: str = "group",
        backend: str = "auto",
    ) -> None:
        self.geometry = geometry
        self.name = name
        self.data = _as_table(data)
        self.first_tier = _as_table(first_tier)
        self.second_tier = _as_table(second_tier)
        expected = (
            ("data", self.data, geometry.data_pages),
            ("first_tier", self.first_tier, geometry.parity_pages),
            ("second_tier", self.second_tier, geometry.second_tier_pages),
        )
        for label, table, count in expected:
            if len(table) != count:
                raise ValueError(
                    f"group {name!r}: expected {count} {label} pages, got {len(table)}"
                )
            if count and table.page_bytes != geometry.page_bytes:
                raise ValueError(
                    f"group {name!r}: {label} pages have {table.page_bytes} bytes, geometry says "
                    f"{geometry.page_bytes}"
                )
        devices = {t.device for _, t, count in expected if count}
        if len(devices) != 1:
            raise ValueError(
                f"group {name!r}: pages lie on several devices {sorted(devices)}; stage parity "
                "onto the data's device first"
            )
        self.device = devices.pop()
        self.first_tier_codec: Codec = get_codec(
            geometry.data_pages,
            geometry.parity_pages,
            device=self.device,
            backend=backend,
            name=name,
            generator=geometry.generator,
        )
        self.second_tier_codec: Codec | None = None
        if geometry.second_tier_pages:
            self.second_tier_codec = get_codec(
                geometry.parity_pages,
                geometry.second_tier_pages,
                device=self.device,
                backend=backend,
                name=f"{name}/second-tier",
            )

    def encode(self) -> None:
        """Compute both tiers from the data."""
        self.first_tier_codec.encode(self.data, self.first_tier)
        self.refresh_second_tier()

    def refresh_second_tier(self) -> None:
        """Recompute the second tier from the first (at the iteration boundary)."""
        if self.second_tier_codec is not None:
            self.second_tier_codec.encode(self.first_tier, self.second_tier)

    def update_chunk(self, old: Pages, *, offset: int, pages: Sequence[int] | None = None) -> None:
        """Fold an in-place update of bytes [offset, offset+L) into the first tier.

        ``first_tier ^= Encode(old ^ new)`` where ``new`` is the data pages' current bytes in
        the range (already updated in place) and ``old`` their pre-update copy (the undo
        buffer). The second tier is left to `refresh_second_tier` at the boundary.

        Args:
            old: the pre-update bytes of the range, one buffer (or `PageTable` row) per page.
            offset: start of the range within each page.
            pages: the data pages that changed (default: all D, in order).
        """
        old_table = _as_table(old)
        length = old_table.page_bytes
        new_table = self.data.slice(offset, length)
        if pages is None:
            self.first_tier_codec.update_from_old_new(
                self.first_tier, old_table, new_table, offset=offset
            )
            return
        index = list(pages)
        if len(index) != len(old_table):
            raise ValueError(
                f"group {self.name!r}: {len(index)} pages named, {len(old_table)} old buffers"
            )
        # Column subsets go through the mapping form (one-page tables: no buffer is resolved
        # again); it keeps the codec's index checks.
        self.first_tier_codec.update_from_old_new(
            self.first_tier,
            {j: old_table.take([i]) for i, j in enumerate(index)},
            {j: new_table.take([j]) for j in index},
            offset=offset,
        )

    def update(self, deltas: PageDeltas, *, offset: int = 0) -> None:
        """XOR data-page deltas (old XOR new) into the first tier; see `Codec.update`."""
        self.first_tier_codec.update(self.first_tier, deltas, offset=offset)

    def reconstruct(self, lost: Collection[int]) -> None:
        """Rebuild lost pages in place (group numbering: data, first tier, second tier).

        Order: second tier repairs first-tier pages (if it can), first tier repairs data pages
        and any remaining first-tier pages, then lost second-tier pages are re-encoded.

        Raises:
            UnrecoverableError: the loss exceeds what both tiers together can repair; no page
                has been written.
        """
        g = self.geometry
        lost_set = set(lost)
        for page in lost_set:
            if not 0 <= page < g.total_pages:
                raise ValueError(f"group {self.name!r}: page {page} out of range")
        lost_data = sorted(p for p in lost_set if p < g.data_pages)
        lost_t1 = sorted(p - g.data_pages for p in lost_set if p in g.first_tier)
        lost_t2 = sorted(p - g.second_tier.start for p in lost_set if p in g.second_tier)

        repair_t1_from_t2 = bool(lost_t1) and len(lost_t1) + len(lost_t2) <= g.second_tier_pages
        remaining_t1 = [] if repair_t1_from_t2 else lost_t1
        if len(lost_data) + len(remaining_t1) > g.parity_pages:
            raise UnrecoverableError(
                group=self.name,
                lost=lost_set,
                detail=(
                    f"data pages {lost_data}, first-tier pages "
                    f"{[g.data_pages + i for i in lost_t1]}, second-tier pages "
                    f"{[g.second_tier.start + i for i in lost_t2]}: {len(lost_data)} lost data "
                    f"pages need as many intact first-tier pages, "
                    f"{g.parity_pages - len(remaining_t1)} remain"
                ),
            )
        if repair_t1_from_t2:
            tiers = PageTable.concat([self.first_tier, self.second_tier])
            self.second_tier_codec.reconstruct(
                tiers, lost_t1 + [g.parity_pages + i for i in lost_t2], group=self.name
            )
            lost_t2 = []
        if lost_data or remaining_t1:
            pages = PageTable.concat([self.data, self.first_tier])
            self.first_tier_codec.reconstruct(
                pages, lost_data + [g.data_pages + i for i in remaining_t1], group=self.name
            )
        if lost_t2:
            tiers = PageTable.concat([self.first_tier, self.second_tier])
            self.second_tier_codec.reconstruct(
                tiers, [g.parity_pages + i for i in lost_t2], group=self.name
            )
