"""The progress marker on its own: a write torn anywhere leaves the last completed write
readable (the torn slot's CRC fails, the other slot wins); and its two replica pages rebuild a
lost marker page from the freshest survivor, at most one write behind."""

from __future__ import annotations

import random
import struct
import zlib

import numpy as np
import pytest
import torch

from unbroken.erasure import UnrecoverableError
from unbroken.update.marker import (
    MARKER_BYTES,
    SLOT_BYTES,
    MarkerReplicas,
    MarkerState,
    ProgressMarker,
    Stage,
)

RECORD_BYTES = 88
"""Bytes of a slot the marker writes: ten 8-byte fields, then the CRC-32 (as 8 bytes)."""


def _marker() -> tuple[torch.Tensor, ProgressMarker]:
    buf = torch.zeros(MARKER_BYTES, dtype=torch.uint8)
    return buf, ProgressMarker(buf)


def _history(marker: ProgressMarker, n: int, after_write=lambda: None) -> list[MarkerState]:
    """n writes through a chunk transaction's stages, with statistics that change;
    `after_write` runs after each."""
    stages = [Stage.GRADS_PROTECTED, Stage.SYNCED, Stage.CHUNK_UPDATING, Stage.PARITY_READY]
    out = []
    for i in range(n):
        out.append(
            marker.write(
                iteration=i // 4,
                stage=stages[i % 4],
                group=i % 3,
                chunk=i % 5,
                loss=1.0 / (i + 1),
                grad_norm=float(i),
                lr=1e-3 * i,
            )
        )
        after_write()
    return out


def test_a_fresh_buffer_has_no_valid_slot():
    _, marker = _marker()
    assert marker.read() is None
    with pytest.raises(RuntimeError, match="not initialized"):
        _ = marker.state


def test_writes_alternate_slots_and_a_new_reader_sees_the_last():
    buf, marker = _marker()
    states = _history(marker, 7)
    assert [s.seq for s in states] == list(range(1, 8))
    assert marker.last_slot == ((7 % 2) * SLOT_BYTES, SLOT_BYTES)
    assert ProgressMarker(buf).read() == states[-1]
    # The slot the last write did not use holds the write before it.
    other = buf.clone()
    other[marker.last_slot[0] : marker.last_slot[0] + SLOT_BYTES] = 0
    assert ProgressMarker(other).read() == states[-2]


@pytest.mark.parametrize("writes_before", [0, 1, 6])
def test_a_write_torn_at_any_byte_leaves_the_previous_write(writes_before):
    """The crash cut the write after its first b bytes (body first, the CRC last): until the
    CRC is complete the reader must return the previous completed write."""
    buf, marker = _marker()
    before = _history(marker, writes_before)
    previous = before[-1] if before else None
    old = buf.clone()
    new_state = marker.write(iteration=9, stage=Stage.SYNCED, loss=0.5, grad_norm=2.0, lr=0.1)
    new = buf.clone()
    record = slice(marker.last_slot[0], marker.last_slot[0] + RECORD_BYTES)
    for b in range(RECORD_BYTES + 1):
        torn = old.clone()
        torn[record.start : record.start + b] = new[record.start : record.start + b]
        complete = torch.equal(torn[record], new[record])  # (the CRC's top bytes are zeros)
        got = ProgressMarker(torn).read()
        assert got == (new_state if complete else previous), f"torn after {b} bytes"
    assert complete


def test_a_write_torn_in_any_subset_of_bytes_never_reads_as_a_mix():
    """Stores need not land in order: any proper subset of the new slot's changed bytes gives
    the previous write or — never — a state that was not written."""
    buf, marker = _marker()
    states = _history(marker, 5)
    old = buf.clone()
    new_state = marker.write(iteration=3, stage=Stage.IDLE, done_iter=3)
    new = buf.clone()
    changed = (old != new).nonzero().flatten().tolist()
    rng = random.Random(0)
    for _ in range(300):
        keep = rng.sample(changed, rng.randrange(len(changed)))  # never all of them
        torn = old.clone()
        torn[keep] = new[keep]
        assert ProgressMarker(torn).read() == states[-1]
    assert ProgressMarker(new).read() == new_state


def _slot_bytes(seq: int, iteration: int, crc_ok: bool = True) -> np.ndarray:
    body = struct.pack("<qqqqqqdddd", seq, iteration, int(Stage.IDLE), 0, 0, iteration - 1,
                       0.0, 0.0, 1.0, 0.0)  # fmt: skip
    crc = zlib.crc32(body) ^ (0 if crc_ok else 1)
    out = np.zeros(SLOT_BYTES, dtype=np.uint8)
    out[:RECORD_BYTES] = np.frombuffer(body + struct.pack("<Q", crc), np.uint8)
    return out


def test_the_valid_slot_with_the_highest_sequence_wins_wherever_it_lies():
    buf, marker = _marker()
    raw = buf.numpy()
    raw[:SLOT_BYTES] = _slot_bytes(seq=8, iteration=80)
    raw[SLOT_BYTES:] = _slot_bytes(seq=7, iteration=70)
    assert marker.read().iteration == 80
    raw[:SLOT_BYTES] = _slot_bytes(seq=8, iteration=80, crc_ok=False)
    assert marker.read().iteration == 70
    raw[SLOT_BYTES:] = _slot_bytes(seq=0, iteration=70)  # CRC fine, but never a real write
    assert marker.read() is None


def test_the_next_write_after_a_torn_one_goes_on_from_the_last_completed_write():
    buf, marker = _marker()
    states = _history(marker, 4)
    old = buf.clone()
    marker.write(iteration=1, stage=Stage.SYNCED)
    start = marker.last_slot[0]
    buf[start : start + RECORD_BYTES - 1] = old[start : start + RECORD_BYTES - 1]  # tear it
    reader = ProgressMarker(buf)
    assert reader.read() == states[-1]
    again = reader.write(iteration=1, stage=Stage.SYNCED)
    assert again.seq == states[-1].seq + 1
    assert ProgressMarker(buf).read() == again


# -- the marker's replica pages ------------------------------------------------------------


def _replicated(n_writes: int) -> tuple[torch.Tensor, ProgressMarker, MarkerReplicas, list]:
    pages = torch.zeros(3, 4096, dtype=torch.uint8)
    marker = ProgressMarker(pages[0][:MARKER_BYTES])
    replicas = MarkerReplicas(pages)
    replicas.encode()
    # After each write the updater copies the slot it wrote to both replica pages.
    states = _history(marker, n_writes, lambda: replicas.copy_range(*marker.last_slot))
    return pages, marker, replicas, states


@pytest.mark.parametrize("lost", [[0], [1], [2], [0, 1], [0, 2], [1, 2]])
def test_any_two_lost_pages_come_back_from_the_third(lost):
    pages, _, replicas, states = _replicated(9)
    truth = pages[0].clone()
    for p in lost:
        pages[p] = 0xA5  # remapped memory holds anything
    replicas.reconstruct(lost)
    for p in range(3):
        assert torch.equal(pages[p], truth), f"page {p}"
    assert ProgressMarker(pages[0][:MARKER_BYTES]).read() == states[-1]


def test_all_three_lost_is_unrecoverable_and_names_the_marker():
    pages, _, replicas, _ = _replicated(3)
    before = pages.clone()
    with pytest.raises(UnrecoverableError, match="marker") as info:
        replicas.reconstruct([0, 1, 2])
    assert info.value.group == "marker"
    assert torch.equal(pages, before)  # nothing written


def test_a_copy_torn_by_the_crash_leaves_the_marker_at_most_one_write_behind():
    """The crash came between the marker write and its copies (or between the two copies):
    a lost marker page is rebuilt from the freshest surviving copy — the first tier first."""
    pages, marker, _, states = _replicated(6)
    last = marker.write(iteration=7, stage=Stage.IDLE, done_iter=7)
    offset, length = marker.last_slot
    pages[1, offset : offset + length] = pages[0, offset : offset + length]  # first copy only
    for lost, expected in (([0], last), ([0, 1], states[-1])):
        trial = pages.clone()
        trial[lost] = 0
        MarkerReplicas(trial).reconstruct(lost)
        assert ProgressMarker(trial[0][:MARKER_BYTES]).read() == expected, lost


def test_skip_takes_the_state_a_writer_outside_the_host_made_and_writes_nothing():
    """The graph updater's replay writes 3n slots on the device; the host's mirror jumps to
    the last of them without touching the buffer, and the next host write follows on."""
    buf, m = _marker()
    m.write(stage=Stage.SYNCED, iteration=4, done_iter=3, loss=1.5)
    before = buf.clone()
    st = m.skip(9, stage=Stage.IDLE, done_iter=4, group=0, chunk=0)
    assert torch.equal(buf, before)
    assert (st.seq, st.stage, st.iteration, st.done_iter, st.loss) == (10, Stage.IDLE, 4, 4, 1.5)
    nxt = m.write(stage=Stage.GRADS_PROTECTED, iteration=5)
    assert nxt.seq == 11 and ProgressMarker(buf).read() == nxt
    with pytest.raises(ValueError):
        m.skip(0)
