"""The GPU's word-level GF(2^8) operands (`unbroken.erasure._word_tables`) against the field,
by emulating the Triton device functions' arithmetic in numpy: the word-table column update
(`gf_column_words`, its byte masks as `gf_byte_mask` forms them) and the bit-plane form (`gf_planes_add`, `gf_xtime`, `gf_planes_sum`)."""

from __future__ import annotations

import numpy as np
import pytest

from unbroken.erasure import gf256
from unbroken.erasure._word_tables import plane_table, word_table


def _reference(coef: np.ndarray, data: np.ndarray) -> np.ndarray:
    """parity[r] = XOR_c coef[r, c]·data[c] over bytes (data: [cols, n] uint8)."""
    mul = gf256.mul_table()
    out = np.zeros((coef.shape[0], data.shape[1]), dtype=np.uint8)
    for r in range(coef.shape[0]):
        for c in range(coef.shape[1]):
            out[r] ^= mul[coef[r, c], data[c]]
    return out


def _byte_mask(w: np.ndarray, s: int) -> np.ndarray:
    """`gf_byte_mask`: w << (7 - s), then each byte's top bit replicated over it (`prmt` in
    sign mode)."""
    x = (w.astype(np.uint32) << np.uint32(7 - s)).astype(np.uint32)
    lanes = x.view(np.uint8).reshape(*w.shape, 4)
    return ((lanes >> 7) * np.uint8(255)).astype(np.uint8).reshape(*w.shape[:-1], -1).view(np.int32)


def _xtime(x: np.ndarray) -> np.ndarray:
    """`gf_xtime` on int32 words (arithmetic shift, as Triton's int32 >>)."""
    return ((x << 1) & np.int32(-16843010)) ^ (((x >> 7) & np.int32(0x01010101)) * np.int32(0x1D))


@pytest.mark.parametrize("rows,cols,rows_p2", [(4, 96, 4), (3, 12, 4), (1, 4, 1), (5, 7, 8)])
def test_word_and_plane_forms_compute_the_fields_parity(rows, cols, rows_p2):
    rng = np.random.default_rng(rows * 100 + cols)
    coef = gf256.cauchy_matrix(cols, rows)
    data = rng.integers(0, 256, size=(cols, 4 * 64), dtype=np.uint8)
    words = data.view(np.int32)  # [cols, 64] packed bytes, little-endian lanes
    want = _reference(coef, data)

    table = word_table(coef, rows_p2).reshape(cols, 8, rows_p2)
    acc = np.zeros((rows_p2, words.shape[1]), dtype=np.int32)
    for c in range(cols):
        for s in range(8):
            m = _byte_mask(words[c], s)
            assert np.array_equal(m, ((words[c] >> s) & np.int32(0x01010101)) * np.int32(255))
            acc ^= m[None, :] & table[c, s][:, None]
    assert np.array_equal(acc[:rows].view(np.uint8), want)
    assert not acc[rows:].any()

    masks = plane_table(coef, rows_p2).reshape(cols, 8, rows_p2)
    planes = np.zeros((8, rows_p2, words.shape[1]), dtype=np.int32)
    for c in range(cols):
        for b in range(8):
            planes[b] ^= words[c][None, :] & masks[c, b][:, None]
    out = _xtime(planes[7]) ^ planes[6]
    for b in range(5, -1, -1):
        out = _xtime(out) ^ planes[b]
    assert np.array_equal(out[:rows].view(np.uint8), want)
    assert not out[rows:].any()


def _xtime_xor(x: np.ndarray, w) -> np.ndarray:
    """`gf_xtime_xor`: the bytes shifted left in their lanes, 0x1D where a top bit was set."""
    return ((x << 1) & np.int32(-16843010)) ^ (_byte_mask(x, 7) & np.int32(0x1D1D1D1D)) ^ w


@pytest.mark.parametrize("stripe,rows", [(64, 3), (5, 2), (3, 1), (1, 3)])
def test_horners_rule_computes_the_vandermonde_tiers_parity(stripe, rows):
    """The fused Horner transaction's arithmetic (`unbroken.update._triton_horner`): per
    segment, h_r = 2^r·h_r ^ w over the stripe rows from the last to the first, then the
    segments' factors (2^r)^(s·d) by their word tables (`transaction._segment_factors`,
    `gf_word_scale`) — the Vandermonde code's parity of the 3·d data columns."""
    from unbroken.update.transaction import _segment_factors

    rng = np.random.default_rng(stripe * 10 + rows)
    data = rng.integers(0, 256, size=(3 * stripe, 4 * 32), dtype=np.uint8)
    words = data.view(np.int32).reshape(3, stripe, -1)  # segment, row, word
    want = _reference(gf256.vandermonde_matrix(3 * stripe, rows), data)

    h = np.zeros((3, 3, words.shape[2]), dtype=np.int32)  # segment, row r, word
    for j in range(stripe - 1, -1, -1):
        for s in range(3):
            w = words[s, j]
            h[s, 0] ^= w
            h[s, 1] = _xtime_xor(h[s, 1], w)
            h[s, 2] = _xtime_xor(_xtime_xor(h[s, 2], 0), w)
    factors = _segment_factors(stripe)  # (r=1, s=1), (1, 2), (2, 1), (2, 2)

    def scale(x, table):
        out = np.zeros_like(x)
        for b in range(8):
            out ^= _byte_mask(x, b) & table[b]
        return out

    delta = [h[0, 0] ^ h[1, 0] ^ h[2, 0]]
    for r in (1, 2):
        f = factors[2 * (r - 1) : 2 * r]
        delta.append(h[0, r] ^ scale(h[1, r], f[0]) ^ scale(h[2, r], f[1]))
    got = np.stack(delta[:rows]).view(np.uint8)
    assert np.array_equal(got, want)
