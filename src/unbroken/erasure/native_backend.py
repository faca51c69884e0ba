"""The fast CPU backend: `_gf_kernels.c`, compiled on first use and called through ctypes.

The C file is compiled with the system C compiler (``$CC``, else ``cc``/``gcc``/``clang``) into
a per-user cache (``$UNBROKEN_CACHE_DIR`` or ``~/.cache/unbroken``), keyed by a hash of the source
and flags (``$UNBROKEN_ERASURE_CFLAGS`` adds flags, e.g. ``-DUB_STAGE_SLICE=2048`` for tuning),
and written by atomic rename so concurrent first uses are safe. An unwritable cache falls back to
``$TMPDIR/unbroken-<uid>``. No compiler means
`NativeUnavailableError`; `get_codec` then falls back to ISA-L or numpy. ctypes releases the GIL
for the duration of each kernel call.
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import numpy as np

from unbroken.erasure import gf256
from unbroken.erasure._buffers import PageTable
from unbroken.erasure.codec import Codec
from unbroken.native import FLAGS, NativeUnavailableError, build_shared, compiler

__all__ = ["ISAS", "NativeCodec", "NativeUnavailableError", "best_isa", "load_library"]

ISAS = {"scalar": 0, "avx2": 1, "gfni512": 2}
"""Kernel variants, in increasing speed; `best_isa` says which this CPU runs."""

_SOURCE = Path(__file__).with_name("_gf_kernels.c")

_compiler = functools.partial(compiler, "unbroken.erasure")


@functools.cache
def load_library() -> ctypes.CDLL:
    """Build (once per source version) and load the kernel library.

    Raises:
        NativeUnavailableError: if it cannot be compiled or loaded.
    """
    flags = (*FLAGS, *os.environ.get("UNBROKEN_ERASURE_CFLAGS", "").split())
    target = build_shared(_SOURCE, "erasure", flags, who="unbroken.erasure")
    try:
        lib = ctypes.CDLL(str(target))
    except OSError as exc:
        raise NativeUnavailableError(f"unbroken.erasure: cannot load {target}: {exc}") from exc
    lib.ub_best_isa.restype = ctypes.c_int
    lib.ub_best_isa.argtypes = []
    lib.ub_gf_apply.restype = ctypes.c_int
    lib.ub_gf_apply.argtypes = [
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
    ]
    return lib


def best_isa() -> str:
    """Name of the fastest kernel variant this CPU supports."""
    code = load_library().ub_best_isa()
    return next(name for name, value in ISAS.items() if value == code)


class NativeCodec(Codec):
    """CPU codec on the compiled kernel (AVX-512+GFNI, AVX2 or portable C).

    Args:
        data_pages: k.
        parity_pages: m.
        name: how error messages name this code.
        isa: force a kernel variant (``gfni512``, ``avx2``, ``scalar``); default the best.

    Raises:
        NativeUnavailableError: no compiler, or the forced variant is not supported here.
    """

    backend = "native"

    def __init__(
        self,
        data_pages: int,
        parity_pages: int,
        *,
        name: str = "code",
        generator: str = "cauchy",
        isa: str | None = None,
    ) -> None:
        super().__init__(data_pages, parity_pages, name=name, generator=generator)
        self._lib = load_library()
        best = self._lib.ub_best_isa()
        if isa is None:
            self._isa = best
        elif isa not in ISAS:
            raise ValueError(f"unknown kernel variant {isa!r}; choose from {sorted(ISAS)}")
        elif ISAS[isa] > best:
            raise NativeUnavailableError(f"this CPU cannot run the {isa} kernel")
        else:
            self._isa = ISAS[isa]
        self._mul = gf256.mul_table()
        self._mul_ptr = self._mul.ctypes.data
        self._operand_cache: dict[bytes, tuple[np.ndarray, np.ndarray, int, int]] = {}

    def _operands(self, coefficients: np.ndarray) -> tuple[np.ndarray, np.ndarray, int, int]:
        # The same few matrices (the generator, its column subsets) recur every iteration:
        # cached with their addresses (a `.ctypes` lookup costs microseconds, and the updater
        # calls this a hundred times per iteration).
        key = coefficients.shape[0].to_bytes(2, "little") + coefficients.tobytes()
        cached = self._operand_cache.get(key)
        if cached is None:
            coef = np.ascontiguousarray(coefficients, dtype=np.uint8)
            aff = np.ascontiguousarray(gf256.affine_qword(coef.T))
            if len(self._operand_cache) >= 64:
                self._operand_cache.clear()
            cached = self._operand_cache[key] = (coef, aff, coef.ctypes.data, aff.ctypes.data)
        return cached

    @property
    def isa(self) -> str:
        """The kernel variant in use."""
        return next(name for name, value in ISAS.items() if value == self._isa)

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
        coef, _aff, coef_ptr, aff_ptr = self._operands(coefficients)
        src = sources.ptrs
        src2 = xor_sources.ptrs if xor_sources is not None else None
        dst = dests.ptrs
        status = self._lib.ub_gf_apply(
            coef.shape[0],
            coef.shape[1],
            coef_ptr,
            aff_ptr,
            self._mul_ptr,
            src.ctypes.data,
            None if src2 is None else src2.ctypes.data,
            dst.ctypes.data,
            length,
            dest_offset,
            int(accumulate),
            self._isa,
        )
        if status != 0:
            raise MemoryError("unbroken.erasure: native kernel could not allocate its tables")
