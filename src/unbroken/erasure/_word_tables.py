"""Coefficient operands of the GPU's CUDA-core GF(2^8) kernels (`_triton_kernels`), built on
the host with numpy. No Triton here: the CPU tests check these tables against the reference
field by emulating the kernels' word arithmetic (`tests/erasure/test_word_tables.py`)."""

from __future__ import annotations

import numpy as np

from unbroken.erasure import gf256

__all__ = ["plane_table", "word_table"]


def word_table(coefficients: np.ndarray, rows_p2: int) -> np.ndarray:
    """``T[c, s, r] = (coef[r, c]·2^s) × 0x01010101`` as int32 (the byte in every lane)."""
    rows, cols = coefficients.shape
    powers = (1 << np.arange(8)).astype(np.uint8)
    products = gf256.mul_table()[coefficients.T[:, None, :], powers[None, :, None]]  # c, s, r
    table = np.zeros((cols, 8, rows_p2), dtype=np.uint32)
    table[:, :, :rows] = products.astype(np.uint32) * np.uint32(0x01010101)
    return table.view(np.int32)


def plane_table(coefficients: np.ndarray, rows_p2: int) -> np.ndarray:
    """``P[c, b, r] = -1`` (all ones) where bit b of coef[r, c] is set, else 0, as int32: the
    column masks of the bit-plane form (`_triton_kernels.gf_planes_add`)."""
    rows, cols = coefficients.shape
    bits = (coefficients.T[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
    table = np.zeros((cols, 8, rows_p2), dtype=np.int32)
    table[:, :, :rows] = -bits.astype(np.int32)
    return table
