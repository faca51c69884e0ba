"""The fused chunk-transaction kernel (`unbroken.update.transaction`): the AdamW step of one
chunk and its new parity range (both tiers) into scratch, in one pass over the chunk.

One program owns a block of BLOCK words at the same offset in every page of the chunk. It
walks the stripe's d rows; for each it loads parameter, gradient and both moments, stores the
stepped values in place (`adamw_math`, the other AdamW kernels' body) and folds the three
deltas old ^ new (as 32-bit words of packed bytes) into the first tier's accumulator. At the
end it reads the committed parity of its words and writes scratch: first tier = committed ^
delta, second tier = committed ^ Encode2(delta) (the second tier codes the first, so its delta
is the code of the first tier's delta). Module-level because Triton resolves a kernel's
callees among its module's globals.
"""

from __future__ import annotations

import triton
import triton.language as tl

from unbroken.erasure._triton_kernels import gf_column_words, gf_planes_add, gf_planes_sum
from unbroken.update._triton_adamw import adamw_math, adamw_scalars

__all__ = ["chunk_transaction_kernel", "stage_tiers", "step_row"]


@triton.jit
def step_row(
    p_ptr, g_ptr, m_ptr, v_ptr, off, inside, decays,
    decay_factor, w1, beta2, w2, sqrt_bias2, eps, step_size, grad_scale,
):  # fmt: skip
    """One stripe row of the chunk stepped in place (`adamw_math`); returns its three deltas
    old ^ new (parameters, exp_avg, exp_avg_sq) as int32 words of packed bytes."""
    p0 = tl.load(p_ptr + off, mask=inside, other=0.0)
    g = tl.load(g_ptr + off, mask=inside, other=0.0)
    m0 = tl.load(m_ptr + off, mask=inside, other=0.0)
    v0 = tl.load(v_ptr + off, mask=inside, other=0.0)
    p, m, v = adamw_math(
        p0, g, m0, v0, decays,
        decay_factor, w1, beta2, w2, sqrt_bias2, eps, step_size, grad_scale,
    )  # fmt: skip
    tl.store(p_ptr + off, p, mask=inside)
    tl.store(m_ptr + off, m, mask=inside)
    tl.store(v_ptr + off, v, mask=inside)
    dp = p0.to(tl.int32, bitcast=True) ^ p.to(tl.int32, bitcast=True)
    dm = m0.to(tl.int32, bitcast=True) ^ m.to(tl.int32, bitcast=True)
    dv = v0.to(tl.int32, bitcast=True) ^ v.to(tl.int32, bitcast=True)
    return dp, dm, dv


@triton.jit
def _fold(a0, a1, a2, a3, a4, a5, a6, a7, w, t1_ptr, c, rows, R1: tl.constexpr, PLANES: tl.constexpr):  # fmt: skip
    """Column c's delta w into the first tier's accumulator(s): a0 alone without PLANES; a0
    of [8·R1, BLOCK] (plane-major) with PLANES == 2, one load of the column's 8·R1 masks."""
    if PLANES == 2:
        mk = tl.load(t1_ptr + c * 8 * R1 + tl.arange(0, 8 * R1))
        a0 = a0 ^ (w[None, :] & mk[:, None])
    elif PLANES:
        a0, a1, a2, a3, a4, a5, a6, a7 = gf_planes_add(
            a0, a1, a2, a3, a4, a5, a6, a7, w, t1_ptr, c, rows, R1
        )
    else:
        a0 = gf_column_words(a0, w, t1_ptr, c, rows, R1)
    return a0, a1, a2, a3, a4, a5, a6, a7


# Long: one kernel body is the point (the step and both tiers' parity folds share registers).
@triton.jit(do_not_specialize=["first_index", "decay_end"])
def chunk_transaction_kernel(
    p_ptr, g_ptr, m_ptr, v_ptr, n_cols, row_stride, first_index, decay_end, c_ptr,
    par_ptr, par_stride, scr_ptr, scr_stride, t1_ptr, t2_ptr, stripe,
    H1: tl.constexpr, R1: tl.constexpr, H2: tl.constexpr, R2: tl.constexpr,
    BLOCK: tl.constexpr, PLANES: tl.constexpr,
):  # fmt: skip
    """p/g/m/v: the chunk's [stripe, n_cols] fp32 views (row stride `row_stride` elements),
    element [0, 0] at flat index `first_index`; c_ptr: the eight AdamW scalars (fp32);
    par/scr: the group's committed parity and the scratch, (H1 + H2) int32 rows of the chunk's
    words (row strides in words); t1: the first tier's table over the 3·stripe data columns
    (`plane_table` with PLANES, else `word_table`), t2: the second tier's `word_table`."""
    col = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = col < n_cols
    decay_factor, w1, beta2, w2, sqrt_bias2, eps, step_size, grad_scale = adamw_scalars(c_ptr)
    rows1 = tl.arange(0, R1)
    if PLANES == 2:
        a0 = tl.zeros([8 * R1, BLOCK], dtype=tl.int32)
    else:
        a0 = tl.zeros([R1, BLOCK], dtype=tl.int32)
    a1 = a0
    a2 = a0
    a3 = a0
    a4 = a0
    a5 = a0
    a6 = a0
    a7 = a0
    for j in range(stripe):
        off = j.to(tl.int64) * row_stride + col
        dp, dm, dv = step_row(
            p_ptr, g_ptr, m_ptr, v_ptr, off, inside, first_index + off < decay_end,
            decay_factor, w1, beta2, w2, sqrt_bias2, eps, step_size, grad_scale,
        )  # fmt: skip
        # Data column of segment s, row j: s·stripe + j (the group's data-page order).
        a0, a1, a2, a3, a4, a5, a6, a7 = _fold(
            a0, a1, a2, a3, a4, a5, a6, a7, dp, t1_ptr, j, rows1, R1, PLANES
        )
        a0, a1, a2, a3, a4, a5, a6, a7 = _fold(
            a0, a1, a2, a3, a4, a5, a6, a7, dm, t1_ptr, stripe + j, rows1, R1, PLANES
        )
        a0, a1, a2, a3, a4, a5, a6, a7 = _fold(
            a0, a1, a2, a3, a4, a5, a6, a7, dv, t1_ptr, 2 * stripe + j, rows1, R1, PLANES
        )
    if PLANES == 2:
        planes = tl.reshape(a0, [8, R1, BLOCK])
        b = tl.arange(0, 8)[:, None, None]
        delta = gf_planes_sum(
            tl.sum(tl.where(b == 0, planes, 0), axis=0),
            tl.sum(tl.where(b == 1, planes, 0), axis=0),
            tl.sum(tl.where(b == 2, planes, 0), axis=0),
            tl.sum(tl.where(b == 3, planes, 0), axis=0),
            tl.sum(tl.where(b == 4, planes, 0), axis=0),
            tl.sum(tl.where(b == 5, planes, 0), axis=0),
            tl.sum(tl.where(b == 6, planes, 0), axis=0),
            tl.sum(tl.where(b == 7, planes, 0), axis=0),
        )
    elif PLANES:
        delta = gf_planes_sum(a0, a1, a2, a3, a4, a5, a6, a7)
    else:
        delta = a0
    stage_tiers(
        delta, col, inside, par_ptr, par_stride, scr_ptr, scr_stride, t2_ptr,
        H1, R1, H2, R2, BLOCK,
    )  # fmt: skip


@triton.jit
def stage_tiers(
    delta, col, inside, par_ptr, par_stride, scr_ptr, scr_stride, t2_ptr,
    H1: tl.constexpr, R1: tl.constexpr, H2: tl.constexpr, R2: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """Scratch = committed parity ^ delta for the first tier's rows (delta: [R1, BLOCK] words of
    columns `col`) and committed ^ Encode2(delta) for the second tier's (the second tier codes
    the first, so its delta is the code of the first tier's delta)."""
    rows1 = tl.arange(0, R1)
    cols = col[None, :]
    both = (rows1 < H1)[:, None] & inside[None, :]
    old = tl.load(par_ptr + rows1[:, None] * par_stride + cols, mask=both, other=0)
    tl.store(scr_ptr + rows1[:, None] * scr_stride + cols, old ^ delta, mask=both)
    if H2 > 0:
        rows2 = tl.arange(0, R2)
        acc2 = tl.zeros([R2, BLOCK], dtype=tl.int32)
        for r in tl.static_range(H1):
            row = tl.sum(tl.where(rows1[:, None] == r, delta, 0), axis=0)
            acc2 = gf_column_words(acc2, row, t2_ptr, r, rows2, R2)
        both2 = (rows2 < H2)[:, None] & inside[None, :]
        at2 = (H1 + rows2)[:, None]
        old2 = tl.load(par_ptr + at2 * par_stride + cols, mask=both2, other=0)
        tl.store(scr_ptr + at2 * scr_stride + cols, old2 ^ acc2, mask=both2)
