"""Arithmetic in GF(2^8) and the generator matrices of the code (Cauchy and Vandermonde).

This module owns the *definition* of the code: the field (polynomial x^8+x^4+x^3+x^2+1, 0x11D,
generator 2 — the field of Intel ISA-L) and the generator matrix. Every backend (numpy, native
CPU, ISA-L, GPU) computes with exactly these coefficients, which is why their parity bytes are
identical. It must never hold per-call state: tables are built once, frozen read-only, and
shared.

Generator: the systematic code's parity row ``r`` (0 ≤ r < m) gives data page ``j`` (0 ≤ j < k)
the coefficient ``1 / ((k + r) XOR j)``, which is ISA-L's ``gf_gen_cauchy1_matrix``. It is a
Cauchy matrix over distinct points {k..k+m-1} and {0..k-1}, so every square submatrix is
invertible and the code is MDS for any k + m ≤ 256. (A Vandermonde generator is not: ISA-L's
``gf_gen_rs_matrix`` fails to decode some patterns at k=240, m=16.)

The Vandermonde generator (`vandermonde_matrix`, for m ≤ 3 only) is ISA-L's
``gf_gen_rs_matrix``: row r gives data page j the coefficient ``x_j^r`` with ``x_j = 2^j``,
rows (1, 2^j, 4^j) — the P, Q and R syndromes of RAID-6 and RAID-Z3. For m ≤ 3 it is MDS for
any k ≤ 255: a square submatrix is a Vandermonde matrix in distinct x (all three rows), or a
2 × 2 minor ``x_a^r x_b^s + x_b^r x_a^s = (x_a x_b)^r (x_a + x_b)^(s-r)`` (s − r ∈ {1, 2}, and
squaring is injective in characteristic 2), or a single nonzero entry. With four rows it is
not (``x^3`` minors vanish where ``x_a / x_b`` is a cube root of unity). Its point is speed:
``XOR_j (2^r)^j·w_j`` is Horner's rule with multiplications by 2 only, which the GPU's fused
chunk transaction computes in a few instructions per word instead of a table per coefficient
(`unbroken.update._triton_horner`).

Matrices here are small (at most 256 × 256); they are handled with numpy and table lookups.
Bulk page arithmetic lives in the backends.
"""

from __future__ import annotations

import functools

import numpy as np

__all__ = [
    "GENERATORS",
    "POLYNOMIAL",
    "SingularMatrixError",
    "affine_qword",
    "cauchy_matrix",
    "exp_table",
    "generator_matrix",
    "inverse",
    "invert_matrix",
    "log_table",
    "matmul",
    "mul",
    "mul_table",
    "vandermonde_matrix",
]

GENERATORS = ("cauchy", "vandermonde")
"""The codes' generator matrices by name (`generator_matrix`)."""

POLYNOMIAL = 0x11D


class SingularMatrixError(ArithmeticError):
    """The matrix has no inverse over GF(2^8)."""


def _frozen(array: np.ndarray) -> np.ndarray:
    array.setflags(write=False)
    return array


@functools.cache
def exp_table() -> np.ndarray:
    """Return ``exp[i] = 2^i`` for i in [0, 510), doubled so that ``exp[log a + log b]`` needs no
    modulo."""
    table = np.zeros(510, dtype=np.uint8)
    value = 1
    for i in range(255):
        table[i] = value
        value <<= 1
        if value & 0x100:
            value ^= POLYNOMIAL
    table[255:] = table[:255]
    return _frozen(table)


@functools.cache
def log_table() -> np.ndarray:
    """Return ``log[a]`` for a in [1, 256) as int32; ``log[0]`` is a sentinel that is never used."""
    table = np.zeros(256, dtype=np.int32)
    table[exp_table()[:255]] = np.arange(255, dtype=np.int32)
    return _frozen(table)


@functools.cache
def mul_table() -> np.ndarray:
    """Return the full 256 × 256 product table ``T[a, b] = a·b`` (64 KiB, uint8)."""
    log = log_table()
    exp = exp_table()
    a = np.arange(256)
    table = exp[log[a][:, None] + log[a][None, :]].astype(np.uint8)
    table[0, :] = 0
    table[:, 0] = 0
    return _frozen(table)


def mul(a: int, b: int) -> int:
    """Multiply two field elements."""
    return int(mul_table()[a, b])


def inverse(a: int) -> int:
    """Return the multiplicative inverse of a non-zero field element.

    Raises:
        ZeroDivisionError: if ``a`` is zero.
    """
    if a == 0:
        raise ZeroDivisionError("0 has no inverse in GF(2^8)")
    return int(exp_table()[255 - log_table()[a]])


def matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Multiply two uint8 matrices over GF(2^8): ``(a @ b)[i, k] = XOR_j a[i, j]·b[j, k]``."""
    a = np.asarray(a, dtype=np.uint8)
    b = np.asarray(b, dtype=np.uint8)
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"cannot multiply matrices of shapes {a.shape} and {b.shape}")
    if a.shape[1] == 0:
        return np.zeros((a.shape[0], b.shape[1]), dtype=np.uint8)
    products = mul_table()[a[:, :, None], b[None, :, :]]
    return np.bitwise_xor.reduce(products, axis=1)


def invert_matrix(matrix: np.ndarray) -> np.ndarray:
    """Invert a square matrix over GF(2^8) by Gauss–Jordan elimination.

    Raises:
        SingularMatrixError: if the matrix is singular.
    """
    m = np.array(matrix, dtype=np.uint8)
    n = m.shape[0]
    if m.shape != (n, n):
        raise ValueError(f"cannot invert a non-square matrix of shape {m.shape}")
    table = mul_table()
    work = np.concatenate([m, np.eye(n, dtype=np.uint8)], axis=1)
    for col in range(n):
        pivots = np.nonzero(work[col:, col])[0]
        if pivots.size == 0:
            raise SingularMatrixError(f"matrix is singular (no pivot in column {col})")
        pivot = col + int(pivots[0])
        if pivot != col:
            work[[col, pivot]] = work[[pivot, col]]
        work[col] = table[inverse(int(work[col, col])), work[col]]
        factors = work[:, col].copy()
        factors[col] = 0
        rows = np.nonzero(factors)[0]
        if rows.size:
            work[rows] ^= table[factors[rows][:, None], work[col][None, :]]
    return work[:, n:].copy()


@functools.cache
def _cauchy(data_pages: int, parity_pages: int) -> np.ndarray:
    if data_pages < 1 or parity_pages < 0 or data_pages + parity_pages > 256:
        raise ValueError(
            f"a GF(2^8) Cauchy code needs 1 ≤ k and k + m ≤ 256, got k={data_pages}, "
            f"m={parity_pages}"
        )
    rows = np.arange(data_pages, data_pages + parity_pages, dtype=np.int64)[:, None]
    cols = np.arange(data_pages, dtype=np.int64)[None, :]
    points = rows ^ cols
    matrix = exp_table()[255 - log_table()[points]].astype(np.uint8)
    return _frozen(matrix)


def cauchy_matrix(data_pages: int, parity_pages: int) -> np.ndarray:
    """Return the m × k parity part of the systematic generator (read-only uint8).

    Args:
        data_pages: k, the number of data pages.
        parity_pages: m, the number of parity pages.

    Raises:
        ValueError: if k < 1, m < 0 or k + m > 256.
    """
    return _cauchy(data_pages, parity_pages)


@functools.cache
def _vandermonde(data_pages: int, parity_pages: int) -> np.ndarray:
    if data_pages < 1 or not 0 <= parity_pages <= 3 or data_pages + parity_pages > 256:
        raise ValueError(
            f"the Vandermonde code needs 1 ≤ k, m ≤ 3 (MDS) and k + m ≤ 256, got k={data_pages}, "
            f"m={parity_pages}"
        )
    rows = np.arange(parity_pages, dtype=np.int64)[:, None]
    cols = np.arange(data_pages, dtype=np.int64)[None, :]
    return _frozen(exp_table()[(rows * cols) % 255].astype(np.uint8))


def vandermonde_matrix(data_pages: int, parity_pages: int) -> np.ndarray:
    """Return the m × k parity part of ISA-L's ``gf_gen_rs_matrix``: ``2^(r·j)`` (read-only).

    Raises:
        ValueError: if k < 1, m > 3 (the code would not be MDS) or k + m > 256.
    """
    return _vandermonde(data_pages, parity_pages)


def generator_matrix(data_pages: int, parity_pages: int, generator: str = "cauchy") -> np.ndarray:
    """The parity part of the systematic code's generator named `generator` (`GENERATORS`).

    Raises:
        ValueError: an unknown generator, or a shape it does not cover.
    """
    if generator == "cauchy":
        return _cauchy(data_pages, parity_pages)
    if generator == "vandermonde":
        return _vandermonde(data_pages, parity_pages)
    raise ValueError(f"unknown generator {generator!r}; choose from {GENERATORS}")


@functools.cache
def _affine_table() -> np.ndarray:
    # GF2P8AFFINEQB computes, per byte x, bit i of the result as parity(A.byte[7 - i] & x). The
    # product c·x is linear in x: column j of its bit matrix is c·2^j, so row i collects the bits
    # j for which bit i of c·2^j is set.
    table = np.zeros(256, dtype=np.uint64)
    mt = mul_table()
    for c in range(256):
        columns = [int(mt[c, 1 << j]) for j in range(8)]
        qword = 0
        for i in range(8):
            row = sum(((columns[j] >> i) & 1) << j for j in range(8))
            qword |= row << (8 * (7 - i))
        table[c] = qword
    return _frozen(table)


def affine_qword(coefficients: np.ndarray) -> np.ndarray:
    """Return the GF2P8AFFINEQB matrix operand (uint64) of each coefficient."""
    return _affine_table()[np.asarray(coefficients, dtype=np.uint8)]
