"""AdamW over a range of the flat state as one GPU kernel (Triton), at memory bandwidth.

The eager `AdamW.update_range` launches about ten element-wise kernels per range, each a full
pass over its operands; this kernel reads parameters, gradient and both moments once and writes
parameters and moments once (28 bytes per fp32 element). It takes a 1-D range or the [rows,
cols] strided view of a chunk (`StateGeometry.chunk_view`): one launch covers a chunk, or the
whole state at once (the plain updater), and since the update is element-wise both compute the
same bits — [Note: chunk-geometry] holds on the GPU with either.

The arithmetic is `AdamW.update_range`'s, term by term (decoupled decay below `decay_end`,
lerp of the first moment, bias corrections, IEEE square root and divisions); it is not
bit-identical to the eager kernels (different rounding of fused terms), so a GPU run computes
with this kernel throughout, plain and protected alike. The CPU never uses it: the CPU
reference keeps its bits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

import torch

from unbroken.train.optim import AdamW

__all__ = ["AdamWCoefficients", "fused_adamw_", "fused_adamw_dev_", "fused_available"]


@dataclass(frozen=True, slots=True)
class AdamWCoefficients:
    """The scalars of one AdamW step, computed on the host in float64 as the eager update
    computes them (then rounded to fp32 by the kernel launch, as torch's scalar arguments are)."""

    decay_factor: float
    """1 - lr * weight_decay (applied below `decay_end` only)."""
    w1: float
    """1 - beta1: the first moment's lerp weight."""
    beta2: float
    w2: float
    """1 - beta2."""
    sqrt_bias2: float
    eps: float
    step_size: float
    """-lr / (1 - beta1 ** step)."""
    grad_scale: float

    def values(self) -> tuple[float, ...]:
        """The eight scalars in the kernels' order (`fused_adamw_dev_` reads them so)."""
        return (
            self.decay_factor,
            self.w1,
            self.beta2,
            self.w2,
            self.sqrt_bias2,
            self.eps,
            self.step_size,
            self.grad_scale,
        )

    @classmethod
    def of(cls, opt: AdamW, *, step: int, lr: float, grad_scale: float) -> AdamWCoefficients:
        return cls(
            decay_factor=1.0 - lr * opt.weight_decay,
            w1=1.0 - opt.beta1,
            beta2=opt.beta2,
            w2=1.0 - opt.beta2,
            sqrt_bias2=math.sqrt(1.0 - opt.beta2**step),
            eps=opt.eps,
            step_size=-lr / (1.0 - opt.beta1**step),
            grad_scale=grad_scale,
        )


@cache
def fused_available() -> bool:
    """Whether the Triton kernel can run here (a CUDA device and Triton installed)."""
    if not torch.cuda.is_available():
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@cache
def _kernels():
    """(scalar-argument kernel, device-coefficient kernel) from `_triton_adamw` (imports
    Triton: CUDA machines only)."""
    from unbroken.update import _triton_adamw as k

    return k.adamw_kernel, k.adamw_kernel_dev


_BLOCK = 2048
_WARPS = 8


def _shape(t: torch.Tensor) -> tuple[int, int, int]:
    """(rows, cols, row stride) of a 1-D contiguous or row-strided 2-D fp32 view."""
    if t.dtype != torch.float32:
        raise ValueError(f"fused AdamW takes fp32 state, got {t.dtype}")
    if t.dim() == 1:
        if t.stride(0) != 1:
            raise ValueError("fused AdamW needs a contiguous 1-D range")
        return 1, t.numel(), t.numel()
    if t.dim() == 2 and t.stride(1) == 1:
        return t.shape[0], t.shape[1], t.stride(0)
    raise ValueError(f"fused AdamW takes a 1-D range or a row-strided 2-D view, got {t.shape}")


def _operands(params, grads, exp_avg, exp_avg_sq) -> tuple[int, int, int]:
    shape = _shape(params)
    for t in (grads, exp_avg, exp_avg_sq):
        if _shape(t) != shape or t.device != params.device:
            raise ValueError("fused AdamW: every operand must have the params' shape and strides")
    return shape


def fused_adamw_(
    params: torch.Tensor,
    grads: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    coeffs: AdamWCoefficients,
    *,
    first_index: int,
    decay_end: int,
) -> None:
    """Update params and moments in place from grads (unchanged), one kernel launch.

    Args:
        params, grads, exp_avg, exp_avg_sq: views of the same shape and strides on one CUDA
            device: a contiguous 1-D range or a [rows, cols] view with unit column stride.
        first_index: the flat element index of element [0] ([0, 0]) of the views.
        decay_end: elements whose flat index is below it get weight decay.

    Raises:
        ValueError: mismatched views, or a layout the kernel does not take.
    """
    _launch(0, (params, grads, exp_avg, exp_avg_sq), first_index, decay_end, coeffs.values())


def fused_adamw_dev_(
    params: torch.Tensor,
    grads: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    coeffs: torch.Tensor,
    *,
    first_index: int,
    decay_end: int,
) -> None:
    """`fused_adamw_` with the scalars read by the kernel from `coeffs` (fp32 [8] on the
    device, `AdamWCoefficients.values()`): a CUDA graph captures the launch once and each
    replay takes the step's scalars from the tensor. Same bits as `fused_adamw_`."""
    if coeffs.dtype != torch.float32 or coeffs.numel() != 8 or coeffs.device != params.device:
        raise ValueError("fused AdamW: coeffs must be 8 fp32 values on the params' device")
    _launch(1, (params, grads, exp_avg, exp_avg_sq), first_index, decay_end, (coeffs,))


def _launch(which: int, views, first_index: int, decay_end: int, scalars) -> None:
    """Launch kernel `which` of `_kernels()` over `views` (checked by `_operands`), one program
    per block of columns and row; `scalars`: the coefficients or their device tensor."""
    rows, cols, stride = _operands(*views)
    if rows == 0 or cols == 0:
        return
    grid = (-(-cols // _BLOCK), rows)
    _kernels()[which][grid](
        *views,
        cols,
        stride,
        first_index,
        decay_end,
        *scalars,
        BLOCK=_BLOCK,
        num_warps=_WARPS,
    )
