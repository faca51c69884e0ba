"""The device-side fingerprint behind a GPU state's hash (`unbroken.train.digest`): exact
integer arithmetic, so it runs here on CPU tensors and gives the bytes' fingerprint whatever the
device; it notices every single-word change and reordering, and a CPU state keeps sha256."""

from __future__ import annotations

import hashlib

import torch

from unbroken.train.digest import P, device_digest


def _state(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def test_the_same_bytes_give_the_same_digest_and_the_slicing_is_part_of_it():
    t = _state(10_000, 1)
    assert device_digest(t) == device_digest(t.clone())
    assert device_digest(t, slice_words=256) == device_digest(t.clone(), slice_words=256)
    assert device_digest(t.view(torch.int32)) == device_digest(t)  # bytes, not values


def test_every_single_bit_flip_and_every_swap_changes_it():
    t = _state(3000, 2)
    base = device_digest(t, slice_words=1024)
    raw = t.view(torch.uint8)
    for i in range(0, raw.numel(), 37):
        for bit in (0, 7):
            raw[i] ^= 1 << bit
            assert device_digest(t, slice_words=1024) != base, (i, bit)
            raw[i] ^= 1 << bit
    words = t.view(torch.int16)
    for i in range(0, words.numel() - 1, 101):
        if words[i] != words[i + 1]:
            words[[i, i + 1]] = words[[i + 1, i]]
            assert device_digest(t, slice_words=1024) != base, i
            words[[i, i + 1]] = words[[i + 1, i]]
    assert device_digest(t, slice_words=1024) == base


def test_a_word_that_differs_by_the_modulus_is_still_noticed():
    """16-bit words stay below p = 2^31 - 1: no difference between two words is a multiple of
    p, which 32-bit words would allow."""
    a = torch.zeros(64, dtype=torch.int32)
    b = a.clone()
    b[5] = P
    assert device_digest(a) != device_digest(b)


def test_a_cpu_states_hash_is_still_sha256_of_its_bytes():
    from unbroken.model.flat import FlatLayout
    from unbroken.train.state import TrainState

    layout = FlatLayout.__new__(FlatLayout)
    st = TrainState(layout, _state(100, 3), _state(100, 4), _state(100, 5), _state(100, 6))
    h = hashlib.sha256()
    for t in (st.params, st.exp_avg, st.exp_avg_sq):
        h.update(t.numpy().tobytes())
    assert st.state_hash() == h.hexdigest()[:16]
