"""The fused AdamW kernels (`unbroken.update.fused_adamw`): one body, launched with the
step's scalars as arguments (`adamw_kernel`) or read from an fp32 [8] device tensor
(`adamw_kernel_dev`, which a CUDA graph captures once and replays with new scalars). fp32
arguments and fp32 loads hold the same rounded values, so both compute the same bits.
Module-level because Triton resolves a kernel's callees among its module's globals."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["adamw_kernel", "adamw_kernel_dev"]


@triton.jit
def adamw_body(
    p_ptr,
    g_ptr,
    m_ptr,
    v_ptr,
    n_cols,
    row_stride,
    first_index,
    decay_end,
    decay_factor,
    w1,
    beta2,
    w2,
    sqrt_bias2,
    eps,
    step_size,
    grad_scale,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(1).to(tl.int64)
    col = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = col < n_cols
    off = row * row_stride + col
    g = tl.load(g_ptr + off, mask=inside, other=0.0) * grad_scale
    p = tl.load(p_ptr + off, mask=inside, other=0.0)
    m = tl.load(m_ptr + off, mask=inside, other=0.0)
    v = tl.load(v_ptr + off, mask=inside, other=0.0)
    p = tl.where(first_index + off < decay_end, p * decay_factor, p)
    m = m + w1 * (g - m)
    v = v * beta2 + w2 * (g * g)
    denom = tl.div_rn(tl.sqrt_rn(v), sqrt_bias2) + eps
    p = p + step_size * tl.div_rn(m, denom)
    tl.store(p_ptr + off, p, mask=inside)
    tl.store(m_ptr + off, m, mask=inside)
    tl.store(v_ptr + off, v, mask=inside)


# first_index and decay_end only enter one comparison: not specialized on their values (Triton
# compiles a variant per divisibility of an int argument), so the shadow's warm-up launch
# compiles the variant every chunk of the job uses.
@triton.jit(do_not_specialize=["first_index", "decay_end"])
def adamw_kernel(
    p_ptr,
    g_ptr,
    m_ptr,
    v_ptr,
    n_cols,
    row_stride,
    first_index,
    decay_end,
    decay_factor,
    w1,
    beta2,
    w2,
    sqrt_bias2,
    eps,
    step_size,
    grad_scale,
    BLOCK: tl.constexpr,
):
    adamw_body(
        p_ptr, g_ptr, m_ptr, v_ptr, n_cols, row_stride, first_index, decay_end,
        decay_factor, w1, beta2, w2, sqrt_bias2, eps, step_size, grad_scale, BLOCK,
    )  # fmt: skip


@triton.jit(do_not_specialize=["first_index", "decay_end"])
def adamw_kernel_dev(
    p_ptr, g_ptr, m_ptr, v_ptr, n_cols, row_stride, first_index, decay_end, c_ptr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    adamw_body(
        p_ptr, g_ptr, m_ptr, v_ptr, n_cols, row_stride, first_index, decay_end,
        tl.load(c_ptr + 0), tl.load(c_ptr + 1), tl.load(c_ptr + 2), tl.load(c_ptr + 3),
        tl.load(c_ptr + 4), tl.load(c_ptr + 5), tl.load(c_ptr + 6), tl.load(c_ptr + 7),
        BLOCK,
    )  # fmt: skip
