"""Intel ISA-L as a backend and as the benchmark baseline, called zero-copy through ctypes.

ISA-L comes from the shared library bundled inside the ``pyeclib`` wheel (``pip install
pyeclib``; the ``bench`` extra), so a user's install reproduces it. `ec_encode_data` has no fused
old^new update, so the update here does what a caller of ISA-L would: XOR the delta into a
cache-sized scratch block, encode the block, XOR the result into the parity. Work proceeds in
slices of `SLICE` bytes so scratch stays in L2 (ISA-L is fastest that way; see PLATFORM-FACTS).
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os

import numpy as np

from unbroken.erasure._buffers import PageTable
from unbroken.erasure.codec import Codec

__all__ = ["IsalCodec", "IsalUnavailableError", "load_isal"]

SLICE = 16384
"""Default bytes per page per ec_encode_data call (the benchmark calibrates its own)."""


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
        return lib
    raise IsalUnavailableError(
        "unbroken.erasure: ISA-L not found; `pip install pyeclib` (it bundles libisal) or set "
        "$UNBROKEN_ISAL_LIBRARY"
    )


class IsalCodec(Codec):
    """CPU codec on Intel ISA-L's ``ec_encode_data`` with the same Cauchy matrix.

    Args:
        data_pages: k.
        parity_pages: m.
        name: how error messages name this code.
        slice_bytes: bytes of each page per ISA-L call (work is sliced to stay in cache).
    """

    backend = "isal"

    def __init__(
        self, data_pages: int, parity_pages: int, *, name: str = "code", slice_bytes: int = SLICE
    ) -> None:
        super().__init__(data_pages, parity_pages, name=name)
        if slice_bytes < 1:
            raise ValueError(f"slice_bytes must be positive, got {slice_bytes}")
        self.slice_bytes = slice_bytes
        self._lib = load_isal()
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
        slice_bytes = min(self.slice_bytes, length)
        fused = xor_sources is not None
        delta = np.empty((cols, slice_bytes), dtype=np.uint8) if fused else None
        scratch = np.empty((rows, slice_bytes), dtype=np.uint8) if accumulate else None
        src_views = sources.numpy_views() if fused else None
        src2_views = xor_sources.numpy_views() if fused else None
        dst_views = dests.numpy_views() if accumulate else None
        delta_ptrs = (
            delta.ctypes.data + np.arange(cols, dtype=np.uint64) * np.uint64(slice_bytes)
            if fused
            else None
        )
        scratch_ptrs = (
            scratch.ctypes.data + np.arange(rows, dtype=np.uint64) * np.uint64(slice_bytes)
            if accumulate
            else None
        )
        for start in range(0, length, slice_bytes):
            n = min(slice_bytes, length - start)
            if fused:
                for c in range(cols):
                    np.bitwise_xor(
                        src_views[c][start : start + n],
                        src2_views[c][start : start + n],
                        out=delta[c, :n],
                    )
                src_ptrs = delta_ptrs
            else:
                src_ptrs = sources.ptrs + np.uint64(start)
            out_ptrs = scratch_ptrs if accumulate else dests.ptrs + np.uint64(dest_offset + start)
            self._lib.ec_encode_data(
                n, cols, rows, tables.ctypes.data, src_ptrs.ctypes.data, out_ptrs.ctypes.data
            )
            if accumulate:
                at = dest_offset + start
                for r in range(rows):
                    dst_views[r][at : at + n] ^= scratch[r, :n]
