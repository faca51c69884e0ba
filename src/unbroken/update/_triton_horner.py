"""The fused chunk transaction for the Vandermonde first tier (`gf256.vandermonde_matrix`,
H1 ≤ 3): the same transaction as `_triton_transaction.chunk_transaction_kernel` — the AdamW
step of one chunk in place and its new parity range (both tiers) into scratch, in one pass —
with the first tier's delta by Horner's rule instead of a coefficient table.

Row r of the Vandermonde tier gives data column c the coefficient ``(2^r)^c``; the chunk's
column of segment s (parameters, exp_avg, exp_avg_sq) and stripe row j is ``c = s·d + j``, so

    delta_r = XOR_s (2^r)^(s·d) · h_{s,r},    h_{s,r} = XOR_j (2^r)^j · w_{s,j}

and each h is Horner's rule over j from d − 1 down to 0: ``h = 2^r·h ^ w``. Per data word that
is one XOR (row 0), one `gf_xtime_xor` (row 1: four instructions) and two (row 2), against
the table kernel's 8·(2 + R1) operations and 8·R1 table loads per word and column, which left
that kernel bound by its instruction issue (bench/results/gpu-h200.md, stops 36-39). The
segment factors ``(2^r)^(s·d)`` are applied once per word at the end (`gf_word_scale`, their
word tables in `f_ptr`: [(r, s) for r in 1..2 for s in 1..2] × 8 words). Module-level because
Triton resolves a kernel's callees among its module's globals.
"""

from __future__ import annotations

import triton
import triton.language as tl

from unbroken.erasure._triton_kernels import gf_word_scale, gf_xtime_xor
from unbroken.update._triton_adamw import adamw_scalars
from unbroken.update._triton_transaction import stage_tiers, step_row

__all__ = ["chunk_transaction_horner_kernel"]


@triton.jit
def _horner(h0, h1, h2, w, H1: tl.constexpr):
    """One step of Horner's rule for rows r < H1: h_r = 2^r·h_r ^ w."""
    h0 = h0 ^ w
    if H1 > 1:
        h1 = gf_xtime_xor(h1, w)
    if H1 > 2:
        h2 = gf_xtime_xor(gf_xtime_xor(h2, 0), w)
    return h0, h1, h2


@triton.jit
def _row(p, m, v, f_ptr):
    """delta_r = h_{0,r} ^ f_{r,1}·h_{1,r} ^ f_{r,2}·h_{2,r} (f_ptr: row r's two factor tables)."""
    return p ^ gf_word_scale(m, f_ptr) ^ gf_word_scale(v, f_ptr + 8)


# Long: one kernel body is the point (the step and both tiers' parity share registers).
@triton.jit(do_not_specialize=["first_index", "decay_end"])
def chunk_transaction_horner_kernel(
    p_ptr, g_ptr, m_ptr, v_ptr, n_cols, row_stride, first_index, decay_end, c_ptr,
    par_ptr, par_stride, scr_ptr, scr_stride, f_ptr, t2_ptr, stripe,
    H1: tl.constexpr, R1: tl.constexpr, H2: tl.constexpr, R2: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """Arguments as `chunk_transaction_kernel`'s, with f_ptr (the segment factors' word tables,
    see the module docstring) in place of the first tier's coefficient table; H1 ≤ 3."""
    col = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = col < n_cols
    decay_factor, w1, beta2, w2, sqrt_bias2, eps, step_size, grad_scale = adamw_scalars(c_ptr)
    z = tl.zeros([BLOCK], dtype=tl.int32)
    p0, p1, p2, m0, m1, m2, v0, v1, v2 = z, z, z, z, z, z, z, z, z
    for i in range(stripe):
        j = stripe - 1 - i
        off = j.to(tl.int64) * row_stride + col
        dp, dm, dv = step_row(
            p_ptr, g_ptr, m_ptr, v_ptr, off, inside, first_index + off < decay_end,
            decay_factor, w1, beta2, w2, sqrt_bias2, eps, step_size, grad_scale,
        )  # fmt: skip
        p0, p1, p2 = _horner(p0, p1, p2, dp, H1)
        m0, m1, m2 = _horner(m0, m1, m2, dm, H1)
        v0, v1, v2 = _horner(v0, v1, v2, dv, H1)
    rows1 = tl.arange(0, R1)[:, None]
    delta = tl.where(rows1 == 0, (p0 ^ m0 ^ v0)[None, :], 0)
    if H1 > 1:
        delta = tl.where(rows1 == 1, _row(p1, m1, v1, f_ptr)[None, :], delta)
    if H1 > 2:
        delta = tl.where(rows1 == 2, _row(p2, m2, v2, f_ptr + 16)[None, :], delta)
    stage_tiers(
        delta, col, inside, par_ptr, par_stride, scr_ptr, scr_stride, t2_ptr,
        H1, R1, H2, R2, BLOCK,
    )  # fmt: skip
