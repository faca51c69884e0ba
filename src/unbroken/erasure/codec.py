"""The codec interface: encode, delta update, fused old/new update and reconstruction of one
(k, m) Reed–Solomon code, on caller-provided buffers, without copies.

Every operation reduces to one primitive that backends implement::

    dst[r][off : off+L]  (=  or  ^=)  XOR_c  coeff[r, c] · (src[c] ^ src2[c])[0 : L]

(`src2` present only for the fused update). This module checks arguments (counts, lengths,
devices, writability) once, so backends only move bytes. It must never allocate page-sized
memory: a backend that needs scratch keeps it bounded (a few cache-sized blocks).
"""

from __future__ import annotations

import abc
from collections.abc import Collection, Mapping, Sequence
from typing import ClassVar

import numpy as np

from unbroken.erasure import gf256
from unbroken.erasure._buffers import Buffer, PageTable
from unbroken.erasure.decoding import plan_reconstruction

__all__ = ["Codec", "PageDeltas", "PageTable", "Pages"]

Pages = Sequence[Buffer] | PageTable
"""An ordered list of equal-length pages: buffers, or a pre-resolved `PageTable`."""

PageDeltas = Mapping[int, Buffer] | PageTable
"""Data-page index → bytes of that page (a buffer, or a one-page `PageTable`); a `PageTable`
instead of a mapping stands for all k pages in order."""


class Codec(abc.ABC):
    """A systematic Reed–Solomon code with k data and m parity pages over GF(2^8).

    Pages are numbered 0..k-1 (data) and k..k+m-1 (parity). All buffers of one call must live
    on the codec's device and, within an operation, have equal lengths (any byte count). Page
    lists may be given as buffers or as a `PageTable` resolved once and reused.

    Args:
        data_pages: k.
        parity_pages: m (k + m ≤ 256).
        name: how error messages name this code or group.
        generator: the generator matrix's name (`gf256.GENERATORS`): ``cauchy`` (any m) or
            ``vandermonde`` (m ≤ 3; the GPU's fused update computes it by Horner's rule).
    """

    backend: ClassVar[str] = "abstract"
    """Short name of the backend (``native``, ``isal``, ``numpy``, ``triton``)."""

    def __init__(
        self, data_pages: int, parity_pages: int, *, name: str = "code", generator: str = "cauchy"
    ) -> None:
        self.data_pages = data_pages
        self.parity_pages = parity_pages
        self.name = name
        self.generator = generator
        self.matrix = gf256.generator_matrix(data_pages, parity_pages, generator)

    @property
    @abc.abstractmethod
    def device(self) -> str:
        """``"cpu"`` or ``"cuda:N"``: where this codec's buffers must live."""

    @abc.abstractmethod
    def _apply(
        self,
        coefficients: np.ndarray,
        sources: PageTable,
        dests: PageTable,
        *,
        xor_sources: PageTable | None,
        length: int,
        dest_offset: int,
        accumulate: bool,
    ) -> None:
        """The primitive above; arguments are already checked (``length`` ≥ 1)."""

    # -- public operations -------------------------------------------------------------------

    def encode(self, data: Pages, parity: Pages) -> None:
        """Compute all parity pages from all data pages (overwrites ``parity``).

        Args:
            data: k equal-length data pages.
            parity: m pages of the same length, written in place.
        """
        sources = self._table(data, self.data_pages, "data pages")
        dests = self._table(parity, self.parity_pages, "parity pages", writable=True)
        length = self._same_length(sources, dests)
        self._run(self.matrix, sources, dests, None, length, 0, accumulate=False)

    def update(self, parity: Pages, deltas: PageDeltas, *, offset: int = 0) -> None:
        """XOR the contribution of data-page deltas into the parity (partial-stripe update).

        ``parity[r][offset : offset+L] ^= XOR_j C[r, j]·deltas[j]``. Because the code is linear,
        this equals re-encoding the new data; it reads only the deltas and the touched parity
        range, so its cost is proportional to the bytes that changed.

        Args:
            parity: the m parity pages (updated in place).
            deltas: data-page index → delta (old XOR new) of length L for the changed pages, or
                a `PageTable` of all k pages' deltas. For a byte range [a, b) of pages, pass
                each page's range and ``offset=a``.
            offset: byte offset in the parity pages where the deltas' range starts.
        """
        columns, sources = self._deltas(deltas, "delta")
        if columns:
            self._accumulate(parity, columns, sources, None, offset)

    def update_from_old_new(
        self, parity: Pages, old: PageDeltas, new: PageDeltas, *, offset: int = 0
    ) -> None:
        """The fused hot path: ``parity[r][offset:offset+L] ^= Encode(old ^ new)[r]``.

        The delta is never materialised. ``old`` is typically the undo buffer's copy of a chunk
        and ``new`` a view of the same chunk after the in-place update.

        Args:
            parity: the m parity pages (updated in place).
            old: data-page index → pre-update bytes (length L), or a `PageTable` of all k pages.
            new: the same pages' post-update bytes, in the same form.
            offset: byte offset of the range in the parity pages.
        """
        columns, sources = self._deltas(old, "old bytes")
        new_columns, xor_sources = self._deltas(new, "new bytes")
        if columns != new_columns:
            raise ValueError(
                f"{self.name}: old and new name different pages: {columns} vs {new_columns}"
            )
        if columns:
            self._accumulate(parity, columns, sources, xor_sources, offset)

    def reconstruct(
        self,
        pages: Sequence[Buffer | None] | PageTable,
        lost: Collection[int] = (),
        *,
        group: str | None = None,
    ) -> None:
        """Rebuild lost pages in place from the survivors, byte-exact.

        Args:
            pages: all k + m pages in code order (data, then parity), as buffers or a
                `PageTable`. A lost page's entry is the (remapped, healthy) buffer to write it
                into, or None to rebuild nothing there.
            lost: indices of lost pages; None entries in ``pages`` are lost too.
            group: name for the error message (defaults to the codec's name).

        Raises:
            UnrecoverableError: more than m pages are lost; nothing was written.
        """
        total = self.data_pages + self.parity_pages
        if len(pages) != total:
            raise ValueError(f"{self.name}: expected {total} pages, got {len(pages)}")
        is_table = isinstance(pages, PageTable)
        lost_set = set(lost)
        if not is_table:
            lost_set |= {i for i, page in enumerate(pages) if page is None}
        if not lost_set:
            return
        plan = plan_reconstruction(
            self.data_pages,
            self.parity_pages,
            lost_set,
            group=group or self.name,
            generator=self.generator,
        )
        if is_table:
            table = self._table(pages, total, "pages")
            sources = table.take(plan.sources)
            dests = self._table(
                table.take(plan.targets), len(plan.targets), "lost pages", writable=True
            )
            self._run(plan.matrix, sources, dests, None, table.page_bytes, 0, accumulate=False)
            return
        wanted = [row for row, page in enumerate(plan.targets) if pages[page] is not None]
        if not wanted:
            return
        sources = self._table([pages[i] for i in plan.sources], len(plan.sources), "survivors")
        dests = self._table(
            [pages[plan.targets[row]] for row in wanted], len(wanted), "lost pages", writable=True
        )
        length = self._same_length(sources, dests)
        matrix = np.ascontiguousarray(plan.matrix[wanted])
        self._run(matrix, sources, dests, None, length, 0, accumulate=False)

    # -- argument checks ---------------------------------------------------------------------

    def _run(
        self,
        coefficients: np.ndarray,
        sources: PageTable,
        dests: PageTable,
        xor_sources: PageTable | None,
        length: int,
        offset: int,
        *,
        accumulate: bool,
    ) -> None:
        if len(dests) and length:
            self._apply(
                coefficients,
                sources,
                dests,
                xor_sources=xor_sources,
                length=length,
                dest_offset=offset,
                accumulate=accumulate,
            )

    def _accumulate(
        self,
        parity: Pages,
        columns: list[int],
        sources: PageTable,
        xor_sources: PageTable | None,
        offset: int,
    ) -> None:
        dests = self._table(parity, self.parity_pages, "parity pages", writable=True)
        length = sources.page_bytes
        if xor_sources is not None and xor_sources.page_bytes != length:
            raise ValueError(
                f"{self.name}: old and new bytes differ in length ({length} vs "
                f"{xor_sources.page_bytes})"
            )
        if offset < 0 or offset + length > dests.page_bytes:
            raise ValueError(
                f"{self.name}: byte range [{offset}, {offset + length}) exceeds parity pages of "
                f"{dests.page_bytes} bytes"
            )
        if columns == list(range(self.data_pages)):
            coefficients = self.matrix
        else:
            coefficients = np.ascontiguousarray(self.matrix[:, columns])
        self._run(coefficients, sources, dests, xor_sources, length, offset, accumulate=True)

    def _deltas(self, pages: PageDeltas, what: str) -> tuple[list[int], PageTable]:
        if isinstance(pages, PageTable):
            table = self._table(pages, self.data_pages, what)
            return list(range(self.data_pages)), table
        columns = sorted(pages)
        if columns and (columns[0] < 0 or columns[-1] >= self.data_pages):
            raise ValueError(
                f"{self.name}: data page indices must lie in [0, {self.data_pages}), got {columns}"
            )
        values = [pages[j] for j in columns]
        if values and all(isinstance(v, PageTable) for v in values):
            return columns, self._table(PageTable.concat(values), len(columns), what)
        return columns, self._table(values, len(columns), what)

    def _table(self, pages: Pages, count: int, what: str, *, writable: bool = False) -> PageTable:
        table = pages if isinstance(pages, PageTable) else PageTable(pages)
        if len(table) != count:
            raise ValueError(f"{self.name}: expected {count} {what}, got {len(table)}")
        if count and table.device != self.device:
            raise ValueError(
                f"{self.name}: {what} are on {table.device}, but the {self.backend} codec works "
                f"on {self.device}"
            )
        if writable and not table.writable:
            raise ValueError(f"{self.name}: {what} are read-only")
        return table

    def _same_length(self, sources: PageTable, dests: PageTable) -> int:
        if len(sources) and len(dests) and sources.page_bytes != dests.page_bytes:
            raise ValueError(
                f"{self.name}: pages of one operation differ in length "
                f"({sources.page_bytes} vs {dests.page_bytes})"
            )
        return dests.page_bytes if len(dests) else sources.page_bytes

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(k={self.data_pages}, m={self.parity_pages}, "
            f"device={self.device!r}, name={self.name!r})"
        )
