"""The GPU backend: the codec on CUDA tensors, through Triton kernels (`_triton_kernels`).

Coefficient operands (the GF(2) bit matrix for the tensor-core kernel, replicated byte words for
the CUDA-core kernel) and device pointer tables are built on the host once and cached per
codec, so the per-iteration path is one kernel launch on the current CUDA stream. Output is
byte-identical to the CPU backends (same field, same generator). Kernel choice: ``xor`` (CUDA
cores, 4-byte aligned work) or ``tc`` (tensor cores, any alignment); ``auto`` takes ``xor`` when
the buffers allow it; and for the Vandermonde code (the GPU's first tier), products by the
code's own matrix — encode and the fused update of all k pages — take Horner's rule
(`_triton_horner`), about a quarter of the table kernel's instructions per word. Calls are
asynchronous like any CUDA op on the current stream.
"""

from __future__ import annotations

import contextlib

import numpy as np
import triton  # noqa: F401  (no Triton: fail at import, so `auto` skips this backend)

from unbroken.erasure import gf256
from unbroken.erasure._buffers import PageTable
from unbroken.erasure._word_tables import plane_table, word_table
from unbroken.erasure.codec import Codec

__all__ = ["DEFAULT_TUNING", "KERNELS", "TritonCodec", "plane_table", "word_table"]

KERNELS = ("auto", "xor", "tc")

DEFAULT_TUNING = {
    "tc_kj": 16,  # data pages per tensor-core step (K = 8 * kj bits)
    "tc_block": 256,  # bytes per program
    "tc_warps": 4,
    "xor_block": 512,  # 32-bit words per program
    "xor_warps": 4,
    "xor_min_block": 128,  # smallest word block for small pages
    "xor_fill": 512,  # shrink blocks / split columns until about this many programs run
    "xor_min_cols": 16,  # but give each split at least this many columns
    "horner": 1,  # 0: the Vandermonde code's own products by the table kernel too (benches)
    "horner_block": 256,  # 32-bit words per program of the Horner kernel
    "horner_warps": 4,
}
"""Launch parameters, chosen by `python -m unbroken.bench.erasure_tuning` on an H200."""
_CACHE_LIMIT = 64


def _cdiv(a: int, b: int) -> int:
    # Not triton.cdiv: on the host it goes through Triton's JIT wrapper (~10 µs a call).
    return -(-a // b)


def _pow2_at_least(n: int, floor: int) -> int:
    value = floor
    while value < n:
        value *= 2
    return value


def bit_matrix(coefficients: np.ndarray, rows_p2: int, cols_pad: int) -> np.ndarray:
    """The GF(2) expansion: ``B[8r+i, 8c+j] = bit i of coef[r, c]·2^j`` (int8, zero-padded)."""
    rows, cols = coefficients.shape
    powers = (1 << np.arange(8)).astype(np.uint8)
    products = gf256.mul_table()[coefficients[:, :, None], powers[None, None, :]]  # r, c, j
    bits = (products[..., None] >> np.arange(8, dtype=np.uint8)) & 1  # r, c, j, i
    expanded = bits.transpose(0, 3, 1, 2).reshape(rows * 8, cols * 8)  # (r, i) x (c, j)
    out = np.zeros((rows_p2 * 8, cols_pad * 8), dtype=np.int8)
    out[: rows * 8, : cols * 8] = expanded
    return out


class TritonCodec(Codec):
    """GPU codec for CUDA tensors.

    Args:
        data_pages: k.
        parity_pages: m.
        name: how error messages name this code.
        device: the CUDA device (``cuda`` or ``cuda:N``).
        kernel: ``auto``, ``xor`` or ``tc`` (see the module docstring).
        tuning: launch parameters overriding `DEFAULT_TUNING` (for the tuner).

    Raises:
        RuntimeError: no CUDA device or no Triton.
    """

    backend = "triton"

    def __init__(
        self,
        data_pages: int,
        parity_pages: int,
        *,
        name: str = "code",
        generator: str = "cauchy",
        device: str = "cuda",
        kernel: str = "auto",
        tuning: dict[str, int] | None = None,
    ) -> None:
        super().__init__(data_pages, parity_pages, name=name, generator=generator)
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device is available")
        if kernel not in KERNELS:
            raise ValueError(f"unknown kernel {kernel!r}; choose from {KERNELS}")
        self._torch = torch
        self._device = torch.device(device if device != "cuda" else "cuda:0")
        if self._device.index is None:
            self._device = torch.device("cuda", torch.cuda.current_device())
        self.kernel = kernel
        self.tuning = {**DEFAULT_TUNING, **(tuning or {})}
        self._operands: dict[tuple, object] = {}
        self._pointer_tables: dict[bytes, object] = {}

    @property
    def device(self) -> str:
        return f"cuda:{self._device.index}"

    # -- cached device-side operands -------------------------------------------------------

    def _cached(self, cache: dict, key, build):
        value = cache.get(key)
        if value is None:
            if len(cache) >= _CACHE_LIMIT:
                cache.clear()
            value = cache[key] = build()
        return value

    def _pointers(self, table: PageTable):
        ptrs = table.ptrs
        return self._cached(
            self._pointer_tables,
            ptrs.tobytes(),
            lambda: self._torch.from_numpy(ptrs.view(np.int64).copy()).to(self._device),
        )

    def _operand(self, kind: str, coefficients: np.ndarray, rows_p2: int):
        key = (kind, coefficients.shape, coefficients.tobytes(), rows_p2)

        def build():
            if kind == "tc":
                kj = self.tuning["tc_kj"]
                cols_pad = -(-coefficients.shape[1] // kj) * kj
                host = bit_matrix(coefficients, rows_p2, cols_pad)
            else:
                host = word_table(coefficients, rows_p2)
            return self._torch.from_numpy(np.ascontiguousarray(host)).to(self._device)

        return self._cached(self._operands, key, build)

    # -- the primitive ----------------------------------------------------------------------

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
        from unbroken.erasure import _triton_kernels as kernels

        coefficients = np.ascontiguousarray(coefficients, dtype=np.uint8)
        rows, cols = coefficients.shape
        src = self._pointers(sources)
        src2 = self._pointers(xor_sources) if xor_sources is not None else src
        low_bits = int(np.bitwise_or.reduce(sources.ptrs)) | int(np.bitwise_or.reduce(dests.ptrs))
        if xor_sources is not None:
            low_bits |= int(np.bitwise_or.reduce(xor_sources.ptrs))
        aligned = (low_bits | length | dest_offset) % 4 == 0
        same_device = self._torch.cuda.current_device() == self._device.index
        if self.kernel == "auto" and aligned and self._horner(coefficients):
            with contextlib.nullcontext() if same_device else self._torch.cuda.device(self._device):
                self._launch_horner(
                    rows, src, src2, self._pointers(dests), length, dest_offset,
                    xor_sources is not None, accumulate,
                )  # fmt: skip
            return
        kernel = self.kernel
        if kernel == "auto":
            kernel = "xor" if aligned else "tc"
        if kernel == "xor" and not aligned:
            raise ValueError(f"{self.name}: the xor kernel needs 4-byte aligned pages and ranges")
        with contextlib.nullcontext() if same_device else self._torch.cuda.device(self._device):
            for r0 in range(0, rows, 16):
                if rows <= 16:
                    block, dst_table = coefficients, dests
                else:
                    block = np.ascontiguousarray(coefficients[r0 : r0 + 16])
                    dst_table = dests.take(range(r0, r0 + block.shape[0]))
                self._launch(
                    kernels,
                    kernel,
                    block,
                    src,
                    src2,
                    self._pointers(dst_table),
                    length,
                    dest_offset,
                    cols,
                    xor_sources is not None,
                    accumulate,
                )

    def update_from_old_new_ptrs(
        self, old_ptrs, new_ptrs, parity_ptrs, *, length: int, offset: int = 0
    ) -> None:
        """`update_from_old_new` over all k data pages, the pages given as device-resident
        pointer tables (int64 CUDA tensors of k, k and m addresses) that the caller built once:
        no page table is resolved or copied per call (the stream updater's hot path).

        Raises:
            ValueError: more than 16 parity pages, or a range not 4-byte aligned.
        """
        from unbroken.erasure import _triton_kernels as kernels

        if self.parity_pages > 16 or (length | offset) % 4:
            raise ValueError(f"{self.name}: pointer updates need m <= 16 and 4-byte ranges")
        coefficients = np.ascontiguousarray(self.matrix, dtype=np.uint8)
        if self.kernel == "auto" and self._horner(coefficients):
            rows = coefficients.shape[0]
            self._launch_horner(rows, old_ptrs, new_ptrs, parity_ptrs, length, offset, True, True)
            return
        self._launch_xor(
            kernels,
            coefficients,
            old_ptrs,
            new_ptrs,
            parity_ptrs,
            length,
            offset,
            self.data_pages,
            True,
            True,
        )

    def prepare_pointer_updates(self):
        """Build now the device table that `update_from_old_new_ptrs` launches with (else built
        on first use: a host-to-device copy, which a CUDA graph's capture refuses) and return
        it: a caller that captures the launch holds it for as long as the graph lives, since
        this codec's cache may drop it."""
        coefficients = np.ascontiguousarray(self.matrix, dtype=np.uint8)
        return self._operand("xor", coefficients, _pow2_at_least(coefficients.shape[0], 1))

    def _horner(self, coefficients: np.ndarray) -> bool:
        """Whether a product by `coefficients` is this Vandermonde code's own (its rows over all
        k columns, in order), which Horner's rule computes (`_triton_horner`)."""
        if self.generator != "vandermonde" or not self.tuning["horner"]:
            return False
        return coefficients is self.matrix or (
            coefficients.shape == self.matrix.shape and np.array_equal(coefficients, self.matrix)
        )

    def _word_block(self, words: int, block_w: int) -> int:
        """`block_w` halved (not below `xor_min_block`) until `words` give about half of
        `xor_fill` programs: small pages still fill the GPU."""
        t = self.tuning
        while block_w > t["xor_min_block"] and _cdiv(words, block_w) < t["xor_fill"] // 2:
            block_w //= 2
        return block_w

    def _launch_horner(self, rows, src, src2, dst, length, dest_offset, fused, accumulate) -> None:
        """One program per word block over all k columns; small pages shrink the block (the
        columns cannot be split, see `_triton_horner`)."""
        from unbroken.erasure._triton_horner import gf_matmul_horner

        t = self.tuning
        words = length // 4
        block_w = self._word_block(words, t["horner_block"])
        gf_matmul_horner[(_cdiv(words, block_w),)](
            src,
            src2,
            dst,
            words,
            dest_offset // 4,
            self.data_pages,
            ROWS=rows,
            BLOCK_W=block_w,
            FUSED=fused,
            ACCUMULATE=accumulate,
            num_warps=t["horner_warps"],
        )

    def _launch(
        self, kernels, kernel, block, src, src2, dst, length, dest_offset, cols, fused, accumulate
    ) -> None:
        args = (kernels, block, src, src2, dst, length, dest_offset, cols, fused, accumulate)
        if kernel == "tc":
            self._launch_tc(*args)
        else:
            self._launch_xor(*args)

    def _launch_tc(
        self, kernels, block, src, src2, dst, length, dest_offset, cols, fused, accumulate
    ) -> None:
        """The tensor-core kernel over the whole range, one program per `tc_block` bytes."""
        rows = block.shape[0]
        t = self.tuning
        rows_p2 = _pow2_at_least(rows, 2)
        bits = self._operand("tc", block, rows_p2)
        block_n = t["tc_block"]
        grid = (_cdiv(length, block_n),)
        kernels.gf_matmul_tc[grid](
            src,
            src2,
            dst,
            bits,
            length,
            dest_offset,
            cols,
            bits.shape[1],
            rows,
            ROWS_P2=rows_p2,
            KJ=t["tc_kj"],
            BLOCK_N=block_n,
            FUSED=fused,
            ACCUMULATE=accumulate,
            num_warps=t["tc_warps"],
        )

    def _launch_xor(
        self, kernels, block, src, src2, dst, length, dest_offset, cols, fused, accumulate
    ) -> None:
        """The CUDA-core XOR kernel, its word block and column splits sized to fill the GPU."""
        rows = block.shape[0]
        t = self.tuning
        rows_p2 = _pow2_at_least(rows, 1)
        table = self._operand("xor", block, rows_p2)
        words = length // 4
        # Small pages: shrink the word block, then split the columns, until the grid can
        # fill the machine (about `xor_fill` programs).
        block_w = self._word_block(words, t["xor_block"])
        blocks = _cdiv(words, block_w)
        splits = max(1, min(t["xor_fill"] // blocks, cols // t["xor_min_cols"]))
        per_split = _cdiv(cols, splits)
        splits = _cdiv(cols, per_split)
        common = {
            "ROWS_P2": rows_p2,
            "BLOCK_W": block_w,
            "FUSED": fused,
            "num_warps": t["xor_warps"],
        }
        if splits > 1 and not accumulate:  # zero the range first (a launch with no columns)
            kernels.gf_matmul_xor[(blocks, 1)](
                src,
                src2,
                dst,
                table,
                words,
                dest_offset // 4,
                0,
                rows,
                1,
                ACCUMULATE=False,
                SPLIT=False,
                **common,
            )
        kernels.gf_matmul_xor[(blocks, splits)](
            src,
            src2,
            dst,
            table,
            words,
            dest_offset // 4,
            cols,
            rows,
            per_split,
            ACCUMULATE=accumulate,
            SPLIT=splits > 1,
            **common,
        )
