"""The stream marker's CRC (`unbroken.update.device_marker`): the position-table form the
kernel computes is zlib's CRC-32 of the marker body, so a slot written by the device reads back
through `ProgressMarker.read` like a host write (the kernel itself runs in the GPU tier)."""

from __future__ import annotations

import random
import zlib

from unbroken.update.device_marker import crc_of


def test_the_table_crc_is_zlibs_crc32_for_random_and_edge_bodies():
    rng = random.Random(5)
    bodies = [bytes(80), bytes([255]) * 80, bytes(range(80))]
    bodies += [bytes(rng.randrange(256) for _ in range(80)) for _ in range(200)]
    for body in bodies:
        assert crc_of(body) == zlib.crc32(body)


def test_one_flipped_bit_anywhere_changes_the_crc():
    body = bytearray(random.Random(9).randbytes(80))
    base = crc_of(bytes(body))
    for i in range(80):
        for bit in range(8):
            body[i] ^= 1 << bit
            assert crc_of(bytes(body)) != base
            body[i] ^= 1 << bit
