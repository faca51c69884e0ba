"""The stream marker's kernels (`unbroken.update.device_marker`, [Note: CRC in the kernel]):
`marker_write` takes the ten body words as arguments; `marker_write_dev` reads the iteration's
words from an int64 device block and takes the transaction's (sequence offset, stage, chunk
position) as arguments, so a CUDA graph captures it once (`unbroken.update.graph`). One body
writes the slot for both. Module-level because Triton resolves a kernel's callees among its
module's globals."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["marker_write", "marker_write_dev"]


@triton.jit
def write_slot(
    pages, table, slot, crc0, w0, w1, w2, w3, w4, w5, w6, w7, w8, w9, PAGE: tl.constexpr
):
    i = tl.arange(0, 128)
    w = i // 8
    zero = tl.zeros([128], dtype=tl.int64)
    word = tl.where(w == 0, zero + w0, zero)
    word = tl.where(w == 1, zero + w1, word)
    word = tl.where(w == 2, zero + w2, word)
    word = tl.where(w == 3, zero + w3, word)
    word = tl.where(w == 4, zero + w4, word)
    word = tl.where(w == 5, zero + w5, word)
    word = tl.where(w == 6, zero + w6, word)
    word = tl.where(w == 7, zero + w7, word)
    word = tl.where(w == 8, zero + w8, word)
    word = tl.where(w == 9, zero + w9, word)
    shift = ((i % 8) * 8).to(tl.int64)
    byte = (word >> shift) & 255
    body = i < 80
    part = tl.load(table + i * 256 + byte, mask=body, other=0)
    crc = tl.xor_sum(part, 0) ^ crc0
    for p in tl.static_range(3):
        tl.store(pages + p * PAGE + slot + i, byte.to(tl.uint8), mask=body)
    # Every thread's body bytes reach memory (system scope) before any CRC byte is stored.
    fenced = tl.inline_asm_elementwise(
        "membar.sys;\n\tmov.b32 $0, $1;", "=r,r", [i], dtype=tl.int32, is_pure=False, pack=1
    )
    tl.debug_barrier()
    tail = (i >= 80) & (i < 88) & (fenced >= 0)
    crc_byte = (crc >> (((i - 80) % 8) * 8).to(tl.int64)) & 255
    for p in tl.static_range(3):
        tl.store(pages + p * PAGE + slot + i, crc_byte.to(tl.uint8), mask=tail)


_WORD_ARGS = [f"w{i}" for i in range(10)]


@triton.jit(do_not_specialize=["slot", "crc0", *_WORD_ARGS])
def marker_write(
    pages, table, slot, crc0, w0, w1, w2, w3, w4, w5, w6, w7, w8, w9, PAGE: tl.constexpr
):
    write_slot(pages, table, slot, crc0, w0, w1, w2, w3, w4, w5, w6, w7, w8, w9, PAGE)


@triton.jit(do_not_specialize=["crc0", "seq_off", "stage", "group", "chunk", "idle"])
def marker_write_dev(
    pages, table, base, crc0, seq_off, stage, group, chunk, idle, PAGE: tl.constexpr
):
    # base: int64 [seq, iteration, done_iter, loss, grad_norm, grad_scale, lr] (see
    # DeviceMarker.base_words); the float fields as their bit patterns.
    seq = tl.load(base + 0) + seq_off
    iteration = tl.load(base + 1)
    done = tl.where(idle != 0, iteration, tl.load(base + 2))
    slot = (seq % 2) * 128  # SLOT_BYTES
    loss, norm, scale, lr = (
        tl.load(base + 3),
        tl.load(base + 4),
        tl.load(base + 5),
        tl.load(base + 6),
    )
    write_slot(
        pages,
        table,
        slot,
        crc0,
        seq,
        iteration,
        stage,
        group,
        chunk,
        done,
        loss,
        norm,
        scale,
        lr,
        PAGE,
    )
