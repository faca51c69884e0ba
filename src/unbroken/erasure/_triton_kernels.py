"""Triton kernels for GF(2^8) matrix-times-pages on CUDA tensors (the GPU backend's compute).

Both kernels compute ``dst[r][off+p] (= or ^=) XOR_c coef[r,c]·(src[c][p] ^ src2[c][p])``
over pages given as device-resident pointer tables, so pages may be scattered in memory.

- `gf_matmul_tc` treats the code as a GF(2) matrix: byte b of page c contributes its bit j to
  parity bit i of row r with weight bit_i(coef[r,c]·2^j). Unpacking data bytes into 0/1 int8
  values turns encoding into an int8 matrix product on tensor cores (``tl.dot``), whose int32
  sums are reduced mod 2 (``& 1``). Any length and alignment.
- `gf_matmul_xor` works on 32-bit words with CUDA cores: for each data bit s it forms a byte
  mask (`gf_byte_mask`: a shift and a byte permute) and XORs in ``mask & (coef·2^s)`` per row
  (one LOP3 per row and bit). Needs 4-byte
  aligned pages, offsets and lengths. Small pages give too few word blocks to fill the GPU, so
  the columns are then split over a second grid axis and partial results combined with
  ``atomic_xor`` (XOR is associative, so the result is exact in any order).

Device functions for kernels that fold a parity delta into other work (the resumable
updater's fused chunk transaction, `unbroken.update._triton_transaction`):

- `gf_column_words`: ``acc[r] ^= coef[r, c]·w`` for one column of packed bytes, with the
  CUDA-core kernel's word table (two operations per data bit, one LOP3 per row and bit);
- `gf_planes_add` / `gf_planes_sum`: the bit-plane form. With ``coef = XOR_b bit_b(coef)·2^b``,
  ``XOR_c coef[r, c]·w_c = XOR_b 2^b·(XOR_{c: bit b of coef[r, c]} w_c)``: per column one LOP3
  per row and coefficient bit into eight plane accumulators (``plane_table``'s all-ones or
  zero masks select the columns), and once per word at the end a Horner sum with
  `gf_xtime` (multiplication by 2 of four packed bytes). Fewer operations per column than
  the word table (8·R against 8·(R + 3)), eight times the accumulators.

Hand-written because no GPU library offers GF(2^8) Reed–Solomon over scattered pages; a torch
table-gather version reached only 3.4 GB/s on an H200 (PLATFORM-FACTS).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = [
    "gf_byte_mask",
    "gf_column_words",
    "gf_matmul_tc",
    "gf_matmul_xor",
    "gf_planes_add",
    "gf_planes_sum",
    "gf_word_scale",
    "gf_xtime",
    "gf_xtime_xor",
]


@triton.jit
def gf_matmul_tc(
    src_ptrs,
    src2_ptrs,
    dst_ptrs,
    bits_ptr,
    length,
    dst_offset,
    cols,
    bits_pitch,
    rows_used,
    ROWS_P2: tl.constexpr,
    KJ: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FUSED: tl.constexpr,
    ACCUMULATE: tl.constexpr,
):
    pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < length
    shifts = tl.arange(0, 8).to(tl.uint8)
    acc = tl.zeros([ROWS_P2 * 8, BLOCK_N], dtype=tl.int32)
    bit_rows = tl.arange(0, ROWS_P2 * 8)
    for c0 in range(0, cols, KJ):
        cj = c0 + tl.arange(0, KJ)
        cmask = cj < cols
        base = tl.load(src_ptrs + cj, mask=cmask, other=0).to(tl.pointer_type(tl.uint8))
        lmask = cmask[:, None] & nmask[None, :]
        x = tl.load(base[:, None] + n[None, :], mask=lmask, other=0)
        if FUSED:
            base2 = tl.load(src2_ptrs + cj, mask=cmask, other=0).to(tl.pointer_type(tl.uint8))
            x = x ^ tl.load(base2[:, None] + n[None, :], mask=lmask, other=0)
        bits = ((x[:, None, :] >> shifts[None, :, None]) & 1).to(tl.int8)
        bits = tl.reshape(bits, [KJ * 8, BLOCK_N])
        kk = c0 * 8 + tl.arange(0, KJ * 8)
        a = tl.load(bits_ptr + bit_rows[:, None] * bits_pitch + kk[None, :])
        acc = tl.dot(a, bits, acc, out_dtype=tl.int32)
    acc = acc & 1
    out = tl.sum(
        tl.reshape(acc, [ROWS_P2, 8, BLOCK_N]) << shifts.to(tl.int32)[None, :, None], axis=1
    )
    rows = tl.arange(0, ROWS_P2)
    rmask = rows < rows_used
    dbase = tl.load(dst_ptrs + rows, mask=rmask, other=0).to(tl.pointer_type(tl.uint8))
    dptr = dbase[:, None] + dst_offset + n[None, :]
    smask = rmask[:, None] & nmask[None, :]
    result = out.to(tl.uint8)
    if ACCUMULATE:
        result = result ^ tl.load(dptr, mask=smask, other=0)
    tl.store(dptr, result, mask=smask)


@triton.jit
def gf_byte_mask(w, S: tl.constexpr):
    """0xFF in each byte of int32 `w` whose bit S is set, else 0x00: the shift takes every
    byte's bit S to that byte's top bit (bits crossing into the next byte are below its top
    bit), and `prmt` in sign mode (selector 0xBA98) replicates each byte's top bit over the
    byte. Two instructions (one for S = 7) instead of ``((w >> S) & 0x01010101) * 255``'s
    three; the word table's inner loop runs it once per data bit and column."""
    x = w
    if S < 7:
        x = w << (7 - S)
    return tl.inline_asm_elementwise(
        "prmt.b32 $0, $1, 0, 0xBA98;", "=r,r", [x], dtype=tl.int32, is_pure=True, pack=1
    )


@triton.jit
def gf_matmul_xor(
    src_ptrs,
    src2_ptrs,
    dst_ptrs,
    table_ptr,
    words,
    dst_word_offset,
    cols,
    rows_used,
    cols_per_split,
    ROWS_P2: tl.constexpr,
    BLOCK_W: tl.constexpr,
    FUSED: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    SPLIT: tl.constexpr,
):
    pid = tl.program_id(0)
    w_idx = pid * BLOCK_W + tl.arange(0, BLOCK_W)
    wmask = w_idx < words
    rows = tl.arange(0, ROWS_P2)
    acc = tl.zeros([ROWS_P2, BLOCK_W], dtype=tl.int32)
    c_start = tl.program_id(1) * cols_per_split
    c_stop = tl.minimum(c_start + cols_per_split, cols)
    for c in range(c_start, c_stop):
        base = tl.load(src_ptrs + c).to(tl.pointer_type(tl.int32))
        w = tl.load(base + w_idx, mask=wmask, other=0)
        if FUSED:
            base2 = tl.load(src2_ptrs + c).to(tl.pointer_type(tl.int32))
            w = w ^ tl.load(base2 + w_idx, mask=wmask, other=0)
        for s in tl.static_range(8):
            m = gf_byte_mask(w, s)
            coef = tl.load(table_ptr + (c * 8 + s) * ROWS_P2 + rows)
            acc = acc ^ (m[None, :] & coef[:, None])
    rmask = rows < rows_used
    dbase = tl.load(dst_ptrs + rows, mask=rmask, other=0).to(tl.pointer_type(tl.int32))
    dptr = dbase[:, None] + dst_word_offset + w_idx[None, :]
    smask = rmask[:, None] & wmask[None, :]
    if SPLIT:  # several programs own disjoint columns of the same words: combine atomically
        tl.atomic_xor(dptr, acc, mask=smask)
    else:
        if ACCUMULATE:
            acc = acc ^ tl.load(dptr, mask=smask, other=0)
        tl.store(dptr, acc, mask=smask)


@triton.jit
def gf_column_words(acc, w, table_ptr, c, rows, ROWS_P2: tl.constexpr):
    """``acc[r, :] ^= coef[r, c]·w`` (acc: [ROWS_P2, B] int32; w: [B] int32 of packed bytes;
    table: `word_table`'s [cols, 8, ROWS_P2])."""
    for s in tl.static_range(8):
        m = gf_byte_mask(w, s)
        coef = tl.load(table_ptr + (c * 8 + s) * ROWS_P2 + rows)
        acc = acc ^ (m[None, :] & coef[:, None])
    return acc


@triton.jit
def gf_planes_add(a0, a1, a2, a3, a4, a5, a6, a7, w, mask_ptr, c, rows, ROWS_P2: tl.constexpr):
    """Plane b of row r takes w where bit b of coef[r, c] is set (`plane_table`'s masks)."""
    base = mask_ptr + c * 8 * ROWS_P2 + rows
    x = w[None, :]
    a0 = a0 ^ (x & tl.load(base)[:, None])
    a1 = a1 ^ (x & tl.load(base + ROWS_P2)[:, None])
    a2 = a2 ^ (x & tl.load(base + 2 * ROWS_P2)[:, None])
    a3 = a3 ^ (x & tl.load(base + 3 * ROWS_P2)[:, None])
    a4 = a4 ^ (x & tl.load(base + 4 * ROWS_P2)[:, None])
    a5 = a5 ^ (x & tl.load(base + 5 * ROWS_P2)[:, None])
    a6 = a6 ^ (x & tl.load(base + 6 * ROWS_P2)[:, None])
    a7 = a7 ^ (x & tl.load(base + 7 * ROWS_P2)[:, None])
    return a0, a1, a2, a3, a4, a5, a6, a7


@triton.jit
def gf_xtime(x):
    """2·x in GF(2^8) (polynomial 0x11D) for each of the four bytes of int32 x."""
    return ((x << 1) & -16843010) ^ (((x >> 7) & 0x01010101) * 0x1D)  # -16843010: 0xFEFEFEFE


@triton.jit
def gf_xtime_xor(x, w):
    """2·x ^ w for each of the four bytes of int32 x: the bytes shifted left within their lanes,
    and 0x1D where a byte's top bit was set (`gf_byte_mask`'s `prmt`). One step of Horner's
    rule for the Vandermonde code's row 1 (`unbroken.update._triton_horner`)."""
    return ((x << 1) & -16843010) ^ (gf_byte_mask(x, 7) & 0x1D1D1D1D) ^ w  # 0xFEFEFEFE


@triton.jit
def gf_word_scale(x, table_ptr):
    """c·x for each of the four bytes of int32 x (any shape), c given by its `word_table`
    column: ``table[s] = (c·2^s) × 0x01010101``, read with stride 1."""
    out = gf_byte_mask(x, 0) & tl.load(table_ptr)
    for s in tl.static_range(1, 8):
        out = out ^ (gf_byte_mask(x, s) & tl.load(table_ptr + s))
    return out


@triton.jit
def gf_planes_sum(a0, a1, a2, a3, a4, a5, a6, a7):
    """XOR_b 2^b·a_b, by Horner's rule."""
    out = gf_xtime(a7) ^ a6
    out = gf_xtime(out) ^ a5
    out = gf_xtime(out) ^ a4
    out = gf_xtime(out) ^ a3
    out = gf_xtime(out) ^ a2
    out = gf_xtime(out) ^ a1
    return gf_xtime(out) ^ a0
