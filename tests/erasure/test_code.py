"""The code itself: field, generator, reconstruction plans, buffers, and agreement with ISA-L."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from unbroken.erasure import (
    BackendUnavailableError,
    PageTable,
    UnrecoverableError,
    get_codec,
    gf256,
    plan_reconstruction,
)


def test_field_inverse_and_product():
    for a in range(1, 256):
        assert gf256.mul(a, gf256.inverse(a)) == 1
    assert gf256.mul(0x53, 0xCA) == gf256.mul(0xCA, 0x53)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 240), st.integers(1, 16), st.data())
def test_every_square_cauchy_submatrix_is_invertible(k, m, draw):
    m = min(m, 256 - k)
    c = gf256.cauchy_matrix(k, m)
    e = draw.draw(st.integers(1, min(k, m)))
    rows = draw.draw(st.lists(st.integers(0, m - 1), min_size=e, max_size=e, unique=True))
    cols = draw.draw(st.lists(st.integers(0, k - 1), min_size=e, max_size=e, unique=True))
    sub = c[np.ix_(rows, cols)]
    inv = gf256.invert_matrix(sub)
    np.testing.assert_array_equal(gf256.matmul(sub, inv), np.eye(e, dtype=np.uint8))


def test_every_square_vandermonde_submatrix_is_invertible_for_the_largest_k():
    """The Vandermonde first tier is MDS (every square submatrix of its m <= 3 rows invertible)
    at k = 253, the most GF(2^8) allows with m = 3: all 1 x 1, 2 x 2 and 3 x 3 minors, by
    their determinants. Four rows are refused: they are not MDS."""
    k = 253
    v = gf256.vandermonde_matrix(k, 3)
    assert v.all()
    mt = gf256.mul_table()
    upper = np.triu_indices(k, 1)
    for r, s in ((0, 1), (0, 2), (1, 2)):
        det = mt[v[r][:, None], v[s][None, :]] ^ mt[v[s][:, None], v[r][None, :]]
        assert det[upper].all(), (r, s)
    for a in range(k):
        for b in range(a + 1, k - 1):
            c = np.arange(b + 1, k)
            x, y, z = v[:, a], v[:, b], v[:, c]
            det = (
                mt[x[0], mt[y[1], z[2]] ^ mt[y[2], z[1]]]
                ^ mt[y[0], mt[x[1], z[2]] ^ mt[x[2], z[1]]]
                ^ mt[z[0], mt[x[1], y[2]] ^ mt[x[2], y[1]]]
            )
            assert det.all(), (a, b)
    np.testing.assert_array_equal(v[:, :4], [[1, 1, 1, 1], [1, 2, 4, 8], [1, 4, 16, 64]])
    with pytest.raises(ValueError, match="MDS"):
        gf256.vandermonde_matrix(8, 4)


@settings(max_examples=30, deadline=None)
@given(st.sets(st.integers(0, 255), min_size=1, max_size=16))
def test_default_geometry_plans_any_16_losses(lost):
    plan = plan_reconstruction(240, 16, lost)
    assert plan.targets == tuple(sorted(lost))
    assert len(plan.sources) == 240 and not set(plan.sources) & lost
    assert plan.matrix.shape == (len(lost), 240)


def test_default_geometry_rebuilds_16_pages_exactly():
    codec = get_codec(240, 16)
    rng = np.random.default_rng(3)
    pages = rng.integers(0, 256, (256, 192), dtype=np.uint8)
    table = PageTable.from_rows(pages)
    codec.encode(table.take(range(240)), table.take(range(240, 256)))
    truth = pages.copy()
    lost = sorted(rng.choice(256, 16, replace=False).tolist())
    pages[lost] = 0
    codec.reconstruct(table, lost)
    np.testing.assert_array_equal(pages, truth)
    with pytest.raises(UnrecoverableError, match="17 lost pages exceed the tolerance of 16"):
        codec.reconstruct(table, list(range(17)))


@pytest.mark.ci_required  # ISA-L is the independent check of our field arithmetic
def test_native_matches_isal_byte_for_byte():
    native = get_codec(240, 16, backend="native")
    try:
        isal = get_codec(240, 16, backend="isal")
    except BackendUnavailableError as exc:
        pytest.skip(str(exc))
    rng = np.random.default_rng(9)
    data = rng.integers(0, 256, (240, 4096 + 17), dtype=np.uint8)
    out_native = np.zeros((16, data.shape[1]), np.uint8)
    out_isal = np.ones((16, data.shape[1]), np.uint8)
    native.encode(PageTable.from_rows(data), PageTable.from_rows(out_native))
    isal.encode(PageTable.from_rows(data), PageTable.from_rows(out_isal))
    np.testing.assert_array_equal(out_native, out_isal)


def test_buffers_of_every_kind_are_used_in_place():
    torch = pytest.importorskip("torch")
    codec = get_codec(3, 2)
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, (3, 128), dtype=np.uint8)
    data = [
        torch.from_numpy(raw[0].copy()),
        bytearray(raw[1].tobytes()),
        raw[2].copy().view(np.float32),  # any dtype: pages are bytes
    ]
    parity = [torch.zeros(32, dtype=torch.float32), np.zeros(128, np.uint8)]
    codec.encode(data, parity)
    expected = gf256.matmul(gf256.cauchy_matrix(3, 2), raw)
    np.testing.assert_array_equal(parity[0].numpy().view(np.uint8), expected[0])
    np.testing.assert_array_equal(parity[1], expected[1])


def test_rejects_non_contiguous_and_read_only_pages():
    codec = get_codec(2, 1)
    page = np.zeros(128, np.uint8)
    with pytest.raises(TypeError, match="contiguous"):
        codec.encode([page[::2], page[::2]], [page[:64]])
    with pytest.raises(ValueError, match="read-only"):
        codec.encode([page, page], [bytes(128)])


def test_page_table_slices_and_takes_without_copies():
    pages = np.arange(4 * 64, dtype=np.uint8).reshape(4, 64)
    table = PageTable.from_rows(pages)
    part = table.take([2, 0]).slice(8, 16)
    assert len(part) == 2 and part.page_bytes == 16
    views = part.numpy_views()
    views[0][:] = 7
    assert (pages[2, 8:24] == 7).all()


def _cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return torch


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["xor", "tc"])
@pytest.mark.parametrize("length", [4096, 65536 + 36, 1 << 20])
def test_gpu_parity_is_byte_identical_to_cpu(kernel, length):
    torch = _cuda()
    from unbroken.erasure.cuda_backend import TritonCodec

    if kernel == "xor" and length % 4:
        pytest.skip("the xor kernel needs 4-byte multiples")
    rng = np.random.default_rng(length)
    host = rng.integers(0, 256, (240, length), dtype=np.uint8)
    cpu_parity = np.zeros((16, length), np.uint8)
    get_codec(240, 16).encode(PageTable.from_rows(host), PageTable.from_rows(cpu_parity))
    data = torch.from_numpy(host).cuda()
    parity = torch.zeros((16, length), dtype=torch.uint8, device="cuda")
    gpu = TritonCodec(240, 16, kernel=kernel)
    gpu.encode(PageTable.from_rows(data), PageTable.from_rows(parity))
    np.testing.assert_array_equal(parity.cpu().numpy(), cpu_parity)
    # the fused update and a 16-page rebuild on the GPU land on the same bytes too
    new = rng.integers(0, 256, (240, length), dtype=np.uint8)
    gpu.update_from_old_new(
        PageTable.from_rows(parity),
        PageTable.from_rows(data),
        PageTable.from_rows(torch.from_numpy(new).cuda()),
    )
    data.copy_(torch.from_numpy(new))
    cpu_new = np.zeros((16, length), np.uint8)
    get_codec(240, 16).encode(PageTable.from_rows(new), PageTable.from_rows(cpu_new))
    np.testing.assert_array_equal(parity.cpu().numpy(), cpu_new)
    everything = torch.cat([data, parity])
    lost = sorted(rng.choice(256, 16, replace=False).tolist())
    everything[lost] = 0
    gpu.reconstruct(PageTable.from_rows(everything), lost)
    np.testing.assert_array_equal(everything.cpu().numpy(), np.concatenate([new, cpu_new]))


@pytest.mark.gpu
@pytest.mark.parametrize("k,m", [(64, 3), (192, 3), (29, 2), (3, 1)])
@pytest.mark.parametrize("length", [4096, 2 << 20])
def test_the_vandermonde_codes_horner_products_equal_the_table_kernels(k, m, length):
    """The Vandermonde code's own products take Horner's rule on the GPU (`_triton_horner`):
    encode, the fused update of all k pages at an offset, the pointer-table update the stream
    updater launches, byte for byte against the word-table kernel and the CPU's encode; a
    product by any other matrix (a rebuild) still takes the table kernel and is exact."""
    torch = _cuda()
    from unbroken.erasure.cuda_backend import TritonCodec

    rng = np.random.default_rng(k * length + m)
    host, new = (rng.integers(0, 256, (k, length), dtype=np.uint8) for _ in range(2))
    cpu = {}
    for name, rows in (("old", host), ("new", new)):
        cpu[name] = np.zeros((m, length), np.uint8)
        get_codec(k, m, generator="vandermonde").encode(
            PageTable.from_rows(rows), PageTable.from_rows(cpu[name])
        )
    out = {}
    for horner in (1, 0):
        codec = TritonCodec(k, m, generator="vandermonde", tuning={"horner": horner})
        assert codec._horner(codec.matrix) == bool(horner)
        data = torch.from_numpy(host).cuda()
        fresh = torch.from_numpy(new).cuda()
        parity = torch.zeros((m, length), dtype=torch.uint8, device="cuda")
        codec.encode(PageTable.from_rows(data), PageTable.from_rows(parity))
        np.testing.assert_array_equal(parity.cpu().numpy(), cpu["old"])
        half = length // 2  # the second half's delta, by page tables, then the first's by pointers
        codec.update_from_old_new(
            PageTable.from_rows(parity),
            PageTable.from_rows(data).slice(half, half),
            PageTable.from_rows(fresh).slice(half, half),
            offset=half,
        )

        def ptrs(t):
            return torch.tensor([t[i].data_ptr() for i in range(len(t))], device="cuda")

        codec.update_from_old_new_ptrs(ptrs(data), ptrs(fresh), ptrs(parity), length=half)
        np.testing.assert_array_equal(parity.cpu().numpy(), cpu["new"])
        everything = torch.cat([fresh, parity])
        lost = sorted(rng.choice(k + m, min(m, k), replace=False).tolist())
        everything[lost] = 0
        codec.reconstruct(PageTable.from_rows(everything), lost)
        np.testing.assert_array_equal(everything.cpu().numpy(), np.concatenate([new, cpu["new"]]))
        out[horner] = parity.cpu().numpy()
    np.testing.assert_array_equal(out[1], out[0])


def test_without_a_compiler_the_native_backend_says_why(monkeypatch):
    from unbroken import native
    from unbroken.erasure import native_backend

    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(native.shutil, "which", lambda name: None)
    with pytest.raises(native_backend.NativeUnavailableError, match="no C compiler"):
        native_backend._compiler()


@pytest.mark.parametrize("isa", ["scalar", "avx2", "gfni512"])
@pytest.mark.parametrize(
    ("k", "m", "length"), [(64, 16, 1300), (240, 4, 2048 + 64 + 5), (30, 20, 777)]
)
def test_native_staged_and_multi_pass_paths_are_exact(isa, k, m, length):
    from unbroken.erasure.native_backend import NativeCodec, NativeUnavailableError

    try:
        codec = NativeCodec(k, m, isa=isa)
    except NativeUnavailableError as exc:
        pytest.skip(str(exc))
    rng = np.random.default_rng(k + m)
    old = rng.integers(0, 256, (k, length), dtype=np.uint8)
    new = rng.integers(0, 256, (k, length), dtype=np.uint8)
    parity = np.zeros((m, length + 64), np.uint8)
    ptab = PageTable.from_rows(parity)
    codec.encode(PageTable.from_rows(old), ptab.slice(0, length))
    expected = gf256.matmul(gf256.cauchy_matrix(k, m), old)
    np.testing.assert_array_equal(parity[:, :length], expected)
    parity[:] = 0
    codec.update_from_old_new(ptab, PageTable.from_rows(old), PageTable.from_rows(new), offset=64)
    np.testing.assert_array_equal(
        parity[:, 64:], gf256.matmul(gf256.cauchy_matrix(k, m), old ^ new)
    )


def test_unrecoverable_error_survives_pickling():
    import pickle

    error = UnrecoverableError(group="g1", lost={5, 2}, detail="why")
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.group, copy.lost, str(copy)) == ("g1", (2, 5), str(error))


def test_pages_in_a_shared_memfd_mapping_are_coded_in_place():
    import mmap
    import os

    page = 4096
    fd = os.memfd_create("erasure-test")
    try:
        os.ftruncate(fd, 6 * page)
        with mmap.mmap(fd, 6 * page) as mapping:
            view = memoryview(mapping)
            pages = [view[i * page : (i + 1) * page] for i in range(6)]
            rng = np.random.default_rng(4)
            for p in pages[:4]:
                p[:] = rng.integers(0, 256, page, dtype=np.uint8).tobytes()
            codec = get_codec(4, 2)
            codec.encode(pages[:4], pages[4:])
            truth = bytes(mapping)
            pages[1][:] = bytes(page)
            pages[5][:] = bytes(page)
            codec.reconstruct(pages, [1, 5])
            assert bytes(mapping) == truth
            del pages, view, p  # release every export before the mapping closes
    finally:
        os.close(fd)
