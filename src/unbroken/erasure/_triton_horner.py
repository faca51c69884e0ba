"""The Vandermonde code's parity by Horner's rule on CUDA tensors: encode and the fused
old/new update of all k data pages, for the GPU's first tier (`gf256.vandermonde_matrix`,
m ≤ 3) and any one-row code.

Row r of the code gives data column c the coefficient ``(2^r)^c``, so

    parity_r = XOR_c (2^r)^c · w_c = (…((w_{k-1}·2^r ^ w_{k-2})·2^r ^ …)·2^r ^ w_0

and a program walks the columns from the last to the first with one accumulator per row:
per data word one XOR (row 0), one `gf_xtime_xor` (row 1: four instructions) and two (row 2).
The word-table kernel (`_triton_kernels.gf_matmul_xor`) spends 8·(2 + R) operations and 8·R
table loads per word and column on the same product, which left the gradients' encode of the
1b preset bound by instruction issue on an H200 (3.8 ms for 3.9 GB; stop 42). The fused
chunk transaction computes the same rule inside its kernel (`unbroken.update._triton_horner`);
this is the codec's own path for everything else a Vandermonde group does whole: the
gradients' protection every iteration, the model's encode at start-up, and the per-chunk
deltas of the stream updater's resumed update.

The columns are not split across programs (a split's partial sums would need a scaling by
``(2^r)^{c0}``): small pages shrink the word block instead. Hand-written for the reason the
other kernels are (`_triton_kernels`' docstring).
"""

from __future__ import annotations

import triton
import triton.language as tl

from unbroken.erasure._triton_kernels import gf_xtime_xor

__all__ = ["gf_matmul_horner"]


@triton.jit
def _store_row(dst_ptrs, r, h, dst_word_offset, w_idx, wmask, ACCUMULATE: tl.constexpr):
    dbase = tl.load(dst_ptrs + r).to(tl.pointer_type(tl.int32))
    dptr = dbase + dst_word_offset + w_idx
    if ACCUMULATE:
        h = h ^ tl.load(dptr, mask=wmask, other=0)
    tl.store(dptr, h, mask=wmask)


@triton.jit
def gf_matmul_horner(
    src_ptrs,
    src2_ptrs,
    dst_ptrs,
    words,
    dst_word_offset,
    cols,
    ROWS: tl.constexpr,
    BLOCK_W: tl.constexpr,
    FUSED: tl.constexpr,
    ACCUMULATE: tl.constexpr,
):
    """``dst[r][off + p] (= or ^=) XOR_c (2^r)^c · (src[c] ^ src2[c])[p]`` for r < ROWS ≤ 3,
    over 32-bit words (pages, offset and length 4-byte aligned); src2 read only if FUSED."""
    w_idx = tl.program_id(0) * BLOCK_W + tl.arange(0, BLOCK_W)
    wmask = w_idx < words
    h0 = tl.zeros([BLOCK_W], dtype=tl.int32)
    h1 = h0
    h2 = h0
    for i in range(cols):
        c = cols - 1 - i
        base = tl.load(src_ptrs + c).to(tl.pointer_type(tl.int32))
        w = tl.load(base + w_idx, mask=wmask, other=0)
        if FUSED:
            base2 = tl.load(src2_ptrs + c).to(tl.pointer_type(tl.int32))
            w = w ^ tl.load(base2 + w_idx, mask=wmask, other=0)
        h0 = h0 ^ w
        if ROWS > 1:
            h1 = gf_xtime_xor(h1, w)
        if ROWS > 2:
            h2 = gf_xtime_xor(gf_xtime_xor(h2, 0), w)
    _store_row(dst_ptrs, 0, h0, dst_word_offset, w_idx, wmask, ACCUMULATE)
    if ROWS > 1:
        _store_row(dst_ptrs, 1, h1, dst_word_offset, w_idx, wmask, ACCUMULATE)
    if ROWS > 2:
        _store_row(dst_ptrs, 2, h2, dst_word_offset, w_idx, wmask, ACCUMULATE)
