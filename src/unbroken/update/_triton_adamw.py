"""The fused AdamW kernels (`unbroken.update.fused_adamw`): one body, launched with the
step's scalars as arguments (`adamw_kernel`) or read from an fp32 [8] device tensor
(`adamw_kernel_dev`, which a CUDA graph captures once and replays with new scalars). fp32
arguments and fp32 loads hold the same rounded values, so both compute the same bits.
Module-level because Triton resolves a kernel's callees among its module's globals."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["adamw_kernel", "adamw_kernel_dev", "adamw_math", "adamw_scalars"]


@triton.jit
def adamw_math(
    p, g, m, v, decays, decay_factor, w1, beta2, w2, sqrt_bias2, eps, step_size, grad_scale
):  # fmt: skip
    """One AdamW step of loaded values (`g` unscaled; `decays` where weight decay applies):
    the new (p, m, v). Every kernel that steps AdamW calls this one body, so they compute the
    same bits (`unbroken.update._triton_transaction` too).

    [Note: explicit fma] Every multiply-add is written as `tl.fma` and no product feeds an
    addition: with a product left to the compiler, whether it is contracted into an fma
    depends on the kernel around it (seen on an H200 with Triton 3.6: the fused transaction
    kernel and the plain AdamW kernel, same expressions, differed in the last bit of the
    moments from the second step on, when m and v are nonzero). The fmas are those Triton
    3.9 contracts the plain expressions to: g·s − m, (g·s − m)·w1 + m, (g·s)²·w2 + v·β2 and
    step·(m / denom) + p."""
    gs = g * grad_scale
    p = tl.where(decays, p * decay_factor, p)
    m = tl.fma(tl.fma(g, grad_scale, -m), w1, m)
    v = tl.fma(gs * gs, w2, v * beta2)
    denom = tl.div_rn(tl.sqrt_rn(v), sqrt_bias2) + eps
    p = tl.fma(step_size, tl.div_rn(m, denom), p)
    return p, m, v


@triton.jit
def adamw_scalars(c_ptr):
    """The eight AdamW scalars of an fp32 [8] device block (`AdamWCoefficients.values`'s
    order: decay_factor, w1, beta2, w2, sqrt_bias2, eps, step_size, grad_scale)."""
    return (
        tl.load(c_ptr + 0), tl.load(c_ptr + 1), tl.load(c_ptr + 2), tl.load(c_ptr + 3),
        tl.load(c_ptr + 4), tl.load(c_ptr + 5), tl.load(c_ptr + 6), tl.load(c_ptr + 7),
    )  # fmt: skip


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
    g = tl.load(g_ptr + off, mask=inside, other=0.0)
    p = tl.load(p_ptr + off, mask=inside, other=0.0)
    m = tl.load(m_ptr + off, mask=inside, other=0.0)
    v = tl.load(v_ptr + off, mask=inside, other=0.0)
    p, m, v = adamw_math(
        p, g, m, v, first_index + off < decay_end,
        decay_factor, w1, beta2, w2, sqrt_bias2, eps, step_size, grad_scale,
    )  # fmt: skip
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
    decay_factor, w1, beta2, w2, sqrt_bias2, eps, step_size, grad_scale = adamw_scalars(c_ptr)
    adamw_body(
        p_ptr, g_ptr, m_ptr, v_ptr, n_cols, row_stride, first_index, decay_end,
        decay_factor, w1, beta2, w2, sqrt_bias2, eps, step_size, grad_scale, BLOCK,
    )  # fmt: skip
