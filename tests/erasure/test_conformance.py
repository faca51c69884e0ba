"""The conformance suite every erasure backend passes: exact encode, delta updates equal to a
full re-encode, exact reconstruction within tolerance, a clear refusal beyond it."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from unbroken.erasure import UnrecoverableError, gf256

SETTINGS = settings(
    max_examples=20,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@st.composite
def codes(draw, max_k: int = 40, max_m: int = 12, max_len: int = 400):
    k = draw(st.integers(1, max_k))
    m = draw(st.integers(1, min(max_m, 256 - k)))
    length = draw(st.integers(1, max_len))
    seed = draw(st.integers(0, 2**32 - 1))
    return k, m, length, seed


def reference_parity(data: np.ndarray, k: int, m: int) -> np.ndarray:
    """parity = C · data over GF(2^8), straight from the definition."""
    return gf256.matmul(gf256.cauchy_matrix(k, m), data)


def encoded(backend, k, m, data):
    codec = backend.make(k, m)
    pages = [backend.buffer(row) for row in data]
    parity = [backend.buffer(np.zeros(data.shape[1], np.uint8)) for _ in range(m)]
    codec.encode(pages, parity)
    return codec, pages, parity


@SETTINGS
@given(codes())
def test_encode_matches_definition(backend, code):
    k, m, length, seed = code
    data = np.random.default_rng(seed).integers(0, 256, (k, length), dtype=np.uint8)
    _, _, parity = encoded(backend, k, m, data)
    expected = reference_parity(data, k, m)
    for r in range(m):
        np.testing.assert_array_equal(backend.read(parity[r]), expected[r])


@SETTINGS
@given(codes(), st.data())
def test_reconstruct_within_tolerance_is_exact(backend, code, draw):
    k, m, length, seed = code
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (k, length), dtype=np.uint8)
    codec, pages, parity = encoded(backend, k, m, data)
    everything = pages + parity
    truth = [backend.read(p) for p in everything]
    lost = draw.draw(st.sets(st.integers(0, k + m - 1), min_size=1, max_size=m))
    for page in lost:  # the lost pages come back as garbage-filled fresh memory
        everything[page] = backend.buffer(rng.integers(0, 256, length, dtype=np.uint8))
    codec.reconstruct(everything, lost)
    for i in range(k + m):
        np.testing.assert_array_equal(backend.read(everything[i]), truth[i], err_msg=f"page {i}")


def _beyond_tolerance_raises_and_writes_nothing(backend, k, m, length, seed, lost) -> None:
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (k, length), dtype=np.uint8)
    codec, pages, parity = encoded(backend, k, m, data)
    everything = pages + parity
    before = [backend.read(p) for p in everything]
    with pytest.raises(UnrecoverableError) as info:
        codec.reconstruct(everything, lost, group="g7")
    assert info.value.group == "g7"
    assert info.value.lost == tuple(sorted(lost))
    assert "g7" in str(info.value) and str(sorted(lost)) in str(info.value)
    for i in range(k + m):
        np.testing.assert_array_equal(backend.read(everything[i]), before[i])


@SETTINGS
@given(codes(max_m=6), st.data())
def test_beyond_tolerance_raises_and_writes_nothing(backend, code, draw):
    k, m, length, seed = code
    lost = draw.draw(st.sets(st.integers(0, k + m - 1), min_size=m + 1, max_size=k + m))
    _beyond_tolerance_raises_and_writes_nothing(backend, k, m, length, seed, lost)


@pytest.mark.parametrize("m", [1, 2, 5])
def test_one_data_page_lost_with_all_its_parity_is_beyond_tolerance(backend, m):
    """k = 1 (a repetition code): the one case where m + 1 losses are every page; hypothesis
    need not draw it, so it is here for sure."""
    _beyond_tolerance_raises_and_writes_nothing(backend, 1, m, 33, m, set(range(1 + m)))


@SETTINGS
@given(codes(), st.data())
def test_delta_update_of_some_pages_equals_reencode(backend, code, draw):
    k, m, length, seed = code
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (k, length), dtype=np.uint8)
    codec, _, parity = encoded(backend, k, m, data)
    changed = draw.draw(st.sets(st.integers(0, k - 1), min_size=1, max_size=k))
    new = data.copy()
    for j in changed:
        new[j] = rng.integers(0, 256, length, dtype=np.uint8)
    deltas = {j: backend.buffer(data[j] ^ new[j]) for j in changed}
    codec.update(parity, deltas)
    expected = reference_parity(new, k, m)
    for r in range(m):
        np.testing.assert_array_equal(backend.read(parity[r]), expected[r])


@pytest.mark.parametrize("fused", [True, False], ids=["old_new", "delta"])
@SETTINGS
@given(codes(), st.data())
def test_range_update_equals_reencode(backend, fused, code, draw):
    """A byte range [a, b) of some pages changes: the fused form (old and new bytes) and the
    delta form (their XOR) both update parity[a:b] to the re-encoded value."""
    k, m, length, seed = code
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (k, length), dtype=np.uint8)
    codec, _, parity = encoded(backend, k, m, data)
    a = draw.draw(st.integers(0, length - 1))
    b = draw.draw(st.integers(a + 1, length))
    changed = sorted(draw.draw(st.sets(st.integers(0, k - 1), min_size=1, max_size=k)))
    new = data.copy()
    for j in changed:
        new[j, a:b] = rng.integers(0, 256, b - a, dtype=np.uint8)
    if fused:
        old = {j: backend.buffer(data[j, a:b]) for j in changed}
        fresh = {j: backend.buffer(new[j, a:b]) for j in changed}
        codec.update_from_old_new(parity, old, fresh, offset=a)
    else:
        codec.update(
            parity, {j: backend.buffer(data[j, a:b] ^ new[j, a:b]) for j in changed}, offset=a
        )
    expected = reference_parity(new, k, m)
    for r in range(m):
        np.testing.assert_array_equal(backend.read(parity[r]), expected[r])


def test_update_with_no_changed_pages_is_a_no_op(backend):
    data = np.arange(3 * 64, dtype=np.uint8).reshape(3, 64)
    codec, _, parity = encoded(backend, 3, 2, data)
    before = [backend.read(p) for p in parity]
    codec.update(parity, {})
    codec.update_from_old_new(parity, {}, {})
    for r in range(2):
        np.testing.assert_array_equal(backend.read(parity[r]), before[r])


def test_rejects_mismatched_arguments(backend):
    codec = backend.make(4, 2)
    page = backend.buffer(np.zeros(64, np.uint8))
    short = backend.buffer(np.zeros(32, np.uint8))
    with pytest.raises(ValueError, match="expected 4 data pages"):
        codec.encode([page] * 3, [page, page])
    with pytest.raises(ValueError, match="differ in length"):
        codec.encode([page, page, page, short], [page, page])
    with pytest.raises(ValueError, match="exceeds parity pages"):
        codec.update([page, page], {0: page}, offset=8)
    with pytest.raises(ValueError, match="data page indices"):
        codec.update([page, page], {4: page})
    with pytest.raises(ValueError, match="different pages"):
        codec.update_from_old_new([page, page], {0: page}, {1: page})


@SETTINGS
@given(codes(max_k=80, max_m=3), st.data())
def test_the_vandermonde_code_encodes_its_definition_and_rebuilds_any_m_losses(backend, code, draw):
    """The GPU default's first tier (`gf256.vandermonde_matrix`, m <= 3) on every backend: the
    parity of ISA-L's gf_gen_rs_matrix, every loss within tolerance rebuilt exactly (the
    decoder inverts its submatrices: MDS), a clear refusal beyond it."""
    k, m, length, seed = code
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (k, length), dtype=np.uint8)
    codec = backend.make(k, m, generator="vandermonde")
    assert codec.generator == "vandermonde"
    pages = [backend.buffer(row) for row in data]
    parity = [backend.buffer(np.zeros(length, np.uint8)) for _ in range(m)]
    codec.encode(pages, parity)
    expected = gf256.matmul(gf256.vandermonde_matrix(k, m), data)
    everything = pages + parity
    truth = [backend.read(p) for p in everything]
    for r in range(m):
        np.testing.assert_array_equal(truth[k + r], expected[r])
    lost = draw.draw(st.sets(st.integers(0, k + m - 1), min_size=1, max_size=m))
    for page in lost:
        everything[page] = backend.buffer(rng.integers(0, 256, length, dtype=np.uint8))
    codec.reconstruct(everything, lost)
    for i in range(k + m):
        np.testing.assert_array_equal(backend.read(everything[i]), truth[i], err_msg=f"page {i}")
    with pytest.raises(UnrecoverableError):
        codec.reconstruct(everything, set(range(min(m + 1, k + m))))
