"""Intel ISA-L as a backend and as the benchmark baseline, called zero-copy through ctypes.

ISA-L comes from the shared library bundled inside the ``pyeclib`` wheel (``pip install
pyeclib``; the ``bench`` extra), so a user's install reproduces it. ISA-L has no fused old^new
update, so the update here does what a careful caller of ISA-L would, in one of two ways
(`UPDATE_METHODS`): ``encode`` XORs the delta into a cache-sized scratch block (one vectorised
XOR per slice when pages are evenly spaced, as rows of one array are), encodes the block with
`ec_encode_data` and XORs the result into the parity; ``mad`` feeds each source's delta to
ISA-L's own `ec_encode_data_update`, which multiplies-and-adds it straight into the parity. Work
proceeds in slices of `SLICE` bytes so scratch stays in cache (the benchmark calibrates the
slice, and the update method, for each shape; see PLATFORM-FACTS).
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os

import numpy as np

from unbroken.erasure._buffers import PageTable
from unbroken.erasure.codec import Codec

__all__ = ["UPDATE_METHODS", "IsalCodec", "IsalUnavailableError", "load_isal"]

SLICE = 16384
"""Default bytes per page per ec_encode_data call (the benchmark calibrates its own)."""

UPDATE_METHODS = ("encode", "mad")
"""How an update is computed: delta → `ec_encode_data` → XOR, or `ec_encode_data_update`."""


class IsalUnavailableError(RuntimeError):
    """No ISA-L library could be found (install ``pyeclib``)."""


@functools.cache
def load_isal() -> ctypes.CDLL:
    """Load ISA-L: ``$UNBROKEN_ISAL_LIBRARY``, else the copy bundled with pyeclib, else the
    system's ``libisal.so.2``.

    Raises:
        IsalUnavailableError: if none loads.
    """
    candidates = []
    if os.environ.get("UNBROKEN_ISAL_LIBRARY"):
        candidates.append(os.environ["UNBROKEN_ISAL_LIBRARY"])
    try:
        import pyeclib

        root = os.path.dirname(os.path.dirname(pyeclib.__file__))
        candidates += sorted(glob.glob(os.path.join(root, "pyeclib.libs", "libisal*.so*")))
    except ImportError:
        pass
    candidates += ["libisal.so.2", "libisal.so"]
    for path in candidates:
        try:
            lib = ctypes.CDLL(path)
            lib.ec_encode_data  # noqa: B018  (probe the symbol)
        except (OSError, AttributeError):
            continue
        voidp, c_int = ctypes.c_void_p, ctypes.c_int
        lib.ec_init_tables.argtypes = [c_int, c_int, voidp, voidp]
        lib.ec_init_tables.restype = None
        lib.ec_encode_data.argtypes = [c_int, c_int, c_int, voidp, voidp, voidp]
        lib.ec_encode_data.restype = None
        if hasattr(lib, "ec_encode_data_update"):
            lib.ec_encode_data_update.argtypes = [c_int, c_int, c_int, c_int, voidp, voidp, voidp]
            lib.ec_encode_data_update.restype = None
        return lib
    raise IsalUnavailableError(
        "unbroken.erasure: ISA-L not found; `pip install pyeclib` (it bundles libisal) or set "
        "$UNBROKEN_ISAL_LIBRARY"
    )


def _rows_view(table: PageTable, length: int) -> np.ndarray | None:
    """A (pages, length) uint8 view of a table whose pages are evenly spaced, non-overlapping
    and in ascending address order (the rows of one array); None otherwise."""
    count = len(table)
    if count == 0:
        return None
    ptrs = table.ptrs
    pitch = int(ptrs[1] - ptrs[0]) if count > 1 and ptrs[1] > ptrs[0] else length
    if pitch < length or (count > 1 and np.any(np.diff(ptrs) != np.uint64(pitch))):
        return None
    span = (count - 1) * pitch + length
    buf = (ctypes.c_uint8 * span).from_address(int(ptrs[0]))
    return np.ndarray((count, length), dtype=np.uint8, buffer=buf, strides=(pitch, 1))


class IsalCodec(Codec):
    """CPU codec on Intel ISA-L's ``ec_encode_data`` with the same Cauchy matrix.

    Args:
        data_pages: k.
        parity_pages: m.
        name: how error messages name this code.
        slice_bytes: bytes of each page per ISA-L call (work is sliced to stay in cache).
        update_method: one of `UPDATE_METHODS` (how updates reach the parity).

    Raises:
        IsalUnavailableError: ``mad`` asked for but the library lacks
            ``ec_encode_data_update``.
    """

    backend = "isal"

    def __init__(
        self,
        data_pages: int,
        parity_pages: int,
        *,
        name: str = "code",
        generator: str = "cauchy",
        slice_bytes: int = SLICE,
        update_method: str = "encode",
    ) -> None:
        super().__init__(data_pages, parity_pages, name=name, generator=generator)
        if slice_bytes < 1:
            raise ValueError(f"slice_bytes must be positive, got {slice_bytes}")
        if update_method not in UPDATE_METHODS:
            raise ValueError(
                f"update_method must be one of {UPDATE_METHODS}, got {update_method!r}"
            )
        self.slice_bytes = slice_bytes
        self.update_method = update_method
        self._lib = load_isal()
        if update_method == "mad" and not hasattr(self._lib, "ec_encode_data_update"):
            raise IsalUnavailableError("unbroken.erasure: this ISA-L lacks ec_encode_data_update")
        self._tables: dict[bytes, np.ndarray] = {}

    @property
    def device(self) -> str:
        return "cpu"

    def _gf_tables(self, coefficients: np.ndarray) -> np.ndarray:
        key = coefficients.shape[0].to_bytes(2, "little") + coefficients.tobytes()
        tables = self._tables.get(key)
        if tables is None:
            rows, cols = coefficients.shape
            coef = np.ascontiguousarray(coefficients, dtype=np.uint8)
            tables = np.zeros(32 * rows * cols, dtype=np.uint8)
            self._lib.ec_init_tables(cols, rows, coef.ctypes.data, tables.ctypes.data)
            if len(self._tables) >= 64:
                self._tables.clear()
            self._tables[key] = tables
        return tables

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
        rows, cols = coefficients.shape
        tables = self._gf_tables(coefficients)
        step = min(self.slice_bytes, length)
        mad = accumulate and self.update_method == "mad"
        delta = _Delta(sources, xor_sources, length, step) if xor_sources is not None else None
        sink = None if mad or not accumulate else _Sink(dests, dest_offset, length, step)
        for start in range(0, length, step):
            n = min(step, length - start)
            src_ptrs = (
                delta.fill(start, n) if delta is not None else sources.ptrs + np.uint64(start)
            )
            out_ptrs = dests.ptrs + np.uint64(dest_offset + start)
            if mad:
                out = out_ptrs.ctypes.data
                for c, src in enumerate(src_ptrs.tolist()):
                    self._lib.ec_encode_data_update(n, cols, rows, c, tables.ctypes.data, src, out)
                continue
            if sink is not None:
                out_ptrs = sink.ptrs
            self._lib.ec_encode_data(
                n, cols, rows, tables.ctypes.data, src_ptrs.ctypes.data, out_ptrs.ctypes.data
            )
            if sink is not None:
                sink.xor_into_dests(start, n)


class _Delta:
    """Cache-sized scratch holding old ^ new for one slice of every source page."""

    def __init__(self, old: PageTable, new: PageTable, length: int, step: int) -> None:
        self.block = np.empty((len(old), step), dtype=np.uint8)
        self.ptrs = PageTable.from_rows(self.block).ptrs
        self.old_rows, self.new_rows = _rows_view(old, length), _rows_view(new, length)
        if self.old_rows is None or self.new_rows is None:
            self.old_pages, self.new_pages = old.numpy_views(), new.numpy_views()

    def fill(self, start: int, n: int) -> np.ndarray:
        """Compute the slice [start, start + n) of the delta; return its page pointers."""
        if self.old_rows is not None and self.new_rows is not None:
            end = start + n
            np.bitwise_xor(
                self.old_rows[:, start:end], self.new_rows[:, start:end], out=self.block[:, :n]
            )
        else:
            for c, (a, b) in enumerate(zip(self.old_pages, self.new_pages, strict=True)):
                np.bitwise_xor(a[start : start + n], b[start : start + n], out=self.block[c, :n])
        return self.ptrs


class _Sink:
    """Cache-sized scratch that ISA-L encodes into, then XORed into the destination pages."""

    def __init__(self, dests: PageTable, offset: int, length: int, step: int) -> None:
        self.block = np.empty((len(dests), step), dtype=np.uint8)
        self.ptrs = PageTable.from_rows(self.block).ptrs
        self.offset = offset
        self.rows = _rows_view(dests.slice(offset, length), length)
        self.pages = dests.numpy_views() if self.rows is None else None

    def xor_into_dests(self, start: int, n: int) -> None:
        if self.rows is not None:
            view = self.rows[:, start : start + n]
            np.bitwise_xor(view, self.block[:, :n], out=view)
            return
        at = self.offset + start
        for r, page in enumerate(self.pages):
            page[at : at + n] ^= self.block[r, :n]
