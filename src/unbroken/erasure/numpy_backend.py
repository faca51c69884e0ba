"""The portable reference backend: GF(2^8) table lookups in numpy.

Slow (well under 1 GB/s) but needs nothing beyond numpy, so it is the fallback when no C
compiler is present, and the reference the conformance suite checks the fast backends against.
It works in bounded blocks so that its temporaries stay cache-sized.
"""

from __future__ import annotations

import numpy as np

from unbroken.erasure import gf256
from unbroken.erasure._buffers import PageTable
from unbroken.erasure.codec import Codec

__all__ = ["NumpyCodec"]

_BLOCK = 1 << 16


class NumpyCodec(Codec):
    """Reference CPU codec (numpy table lookups)."""

    backend = "numpy"

    @property
    def device(self) -> str:
        return "cpu"

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
        table = gf256.mul_table()
        src = sources.numpy_views()
        src2 = xor_sources.numpy_views() if xor_sources is not None else None
        dst = dests.numpy_views()
        for start in range(0, length, _BLOCK):
            stop = min(start + _BLOCK, length)
            acc = np.zeros((len(dst), stop - start), dtype=np.uint8)
            for c in range(len(src)):
                block = src[c][start:stop]
                if src2 is not None:
                    block = block ^ src2[c][start:stop]
                for r in range(len(dst)):
                    coefficient = coefficients[r, c]
                    if coefficient == 1:
                        acc[r] ^= block
                    elif coefficient:
                        acc[r] ^= table[coefficient][block]
            for r in range(len(dst)):
                target = dst[r][dest_offset + start : dest_offset + stop]
                if accumulate:
                    target ^= acc[r]
                else:
                    target[:] = acc[r]
