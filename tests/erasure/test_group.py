"""Two-tier protection groups: repair order, tolerance, and the chunked update path."""

from __future__ import annotations

import numpy as np
import pytest

from unbroken.erasure import (
    ErasureGeometry,
    GeometryError,
    PageTable,
    ProtectionGroup,
    UnrecoverableError,
)

PAGE = 256


def make_group(d=12, h1=4, h2=1, seed=0, backend="auto"):
    geometry = ErasureGeometry(page_bytes=PAGE, data_pages=d, parity_pages=h1, second_tier_pages=h2)
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (d, PAGE), dtype=np.uint8)
    tier1 = np.zeros((h1, PAGE), np.uint8)
    tier2 = np.zeros((h2, PAGE), np.uint8)
    group = ProtectionGroup(
        geometry,
        PageTable.from_rows(data),
        PageTable.from_rows(tier1),
        PageTable.from_rows(tier2),
        name="g3",
        backend=backend,
    )
    group.encode()
    return group, np.concatenate([data, tier1, tier2]), (data, tier1, tier2)


def wipe(arrays, pages, d, h1):
    data, tier1, tier2 = arrays
    for p in pages:
        target = data[p] if p < d else tier1[p - d] if p < d + h1 else tier2[p - d - h1]
        target[:] = 0xA5


def current(arrays):
    return np.concatenate(arrays)


@pytest.mark.parametrize(
    "lost",
    [
        [0, 1, 2, 3],  # H1 data pages
        [12],  # one tier-1 page: from tier 2
        [16],  # the tier-2 page: re-encoded
        [0, 1, 2, 3, 12],  # H1 data pages + one tier-1 page: only possible via tier 2 first
        [0, 1, 12, 13],  # two tier-1 pages: beyond tier 2, rebuilt from data instead
        [5, 12, 16],  # tier-1 and tier-2 both lost: tier 1 from data, then tier 2
    ],
)
def test_two_tier_repair(lost):
    group, truth, arrays = make_group()
    wipe(arrays, lost, 12, 4)
    group.reconstruct(lost)
    np.testing.assert_array_equal(current(arrays), truth)


@pytest.mark.parametrize("lost", [[0, 1, 2, 3, 4], [0, 1, 2, 12, 13], [0, 1, 2, 3, 12, 16]])
def test_beyond_both_tiers_raises_without_writing(lost):
    group, _, arrays = make_group()
    wipe(arrays, lost, 12, 4)
    before = current(arrays)
    with pytest.raises(UnrecoverableError, match=r"'g3' is not recoverable") as info:
        group.reconstruct(lost)
    assert info.value.lost == tuple(sorted(lost))
    np.testing.assert_array_equal(current(arrays), before)


def test_chunk_updates_track_the_data():
    group, _, (data, tier1, tier2) = make_group(d=20, h1=6, h2=2, seed=5)
    rng = np.random.default_rng(1)
    for a, b in [(0, 64), (64, 200), (200, PAGE)]:  # the updater's chunks over every page
        undo = data[:, a:b].copy()
        data[:, a:b] = rng.integers(0, 256, (20, b - a), dtype=np.uint8)
        group.update_chunk(PageTable.from_rows(undo), offset=a)
    undo = data[[3, 7], 10:50].copy()  # a few pages only
    data[[3, 7], 10:50] ^= 0x5A
    group.update_chunk([undo[0], undo[1]], offset=10, pages=[3, 7])
    group.refresh_second_tier()
    fresh, _, (_, t1, t2) = make_group(d=20, h1=6, h2=2, seed=5)
    fresh.data = PageTable.from_rows(data)
    fresh.encode()
    np.testing.assert_array_equal(tier1, t1)
    np.testing.assert_array_equal(tier2, t2)


def test_group_rejects_wrong_page_counts():
    geometry = ErasureGeometry(page_bytes=PAGE, data_pages=4, parity_pages=2, second_tier_pages=1)
    pages = np.zeros((7, PAGE), np.uint8)
    with pytest.raises(ValueError, match="expected 4 data pages"):
        ProtectionGroup(geometry, list(pages[:3]), list(pages[4:6]), list(pages[6:]))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"page_bytes": 100}, "multiple of 64"),
        ({"data_pages": 0}, "data_pages"),
        ({"parity_pages": 0}, "parity_pages"),
        ({"data_pages": 250, "parity_pages": 16}, "≤ 256"),
        ({"second_tier_pages": -1}, "second_tier_pages"),
        ({"data_pages": 2.0}, "must be an int"),
    ],
)
def test_geometry_is_validated_at_construction(kwargs, message):
    with pytest.raises(GeometryError, match=message):
        ErasureGeometry(**kwargs)


def test_default_geometry_is_the_documented_one():
    g = ErasureGeometry()
    assert (g.page_bytes, g.data_pages, g.parity_pages, g.second_tier_pages) == (
        2 << 20,
        240,
        16,
        1,
    )
    assert g.group_bytes == 480 << 20
    assert list(g.second_tier) == [256]


@pytest.mark.gpu
def test_group_on_cuda_tensors_matches_the_cpu_group():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    group_cpu, truth, _ = make_group(d=40, h1=8, h2=2, seed=11)
    geometry = group_cpu.geometry
    pages = torch.from_numpy(truth.copy()).cuda()
    pages[40:] = 0
    group = ProtectionGroup(
        geometry,
        PageTable.from_rows(pages[:40]),
        PageTable.from_rows(pages[40:48]),
        PageTable.from_rows(pages[48:]),
        name="gpu-group",
    )
    assert group.first_tier_codec.backend == "triton"
    group.encode()
    np.testing.assert_array_equal(pages.cpu().numpy(), truth)
    lost = [0, 5, 9, 17, 23, 31, 39, 40]  # 7 data pages and one tier-1 page (from tier 2)
    pages[lost] = 0
    group.reconstruct(lost)
    np.testing.assert_array_equal(pages.cpu().numpy(), truth)


def test_host_pages_map_into_a_cuda_device_by_their_addresses_and_nothing_else_does():
    host = np.zeros((3, PAGE), np.uint8)
    table = PageTable.from_rows(host)
    mapped = table.mapped_into("cuda:1")
    assert mapped.device == "cuda:1" and table.device == "cpu"
    assert np.array_equal(mapped.ptrs, table.ptrs) and mapped.page_bytes == PAGE
    assert mapped.slice(64, 64).device == "cuda:1"  # derived tables keep the device
    with pytest.raises(ValueError, match="only host pages"):
        mapped.mapped_into("cuda:0")
    with pytest.raises(ValueError, match="only host pages"):
        table.mapped_into("cpu")


@pytest.mark.gpu
def test_a_gpu_group_with_its_parity_in_registered_host_memory_encodes_and_repairs_in_place():
    """The model's parity in host memory (the GPU default): the Triton codec reads and writes
    the registered host pages through their mapped addresses."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    group_cpu, truth, _ = make_group(d=40, h1=8, h2=2, seed=12)
    data = torch.from_numpy(truth[:40].copy()).cuda()
    parity = torch.zeros((10, PAGE), dtype=torch.uint8, pin_memory=True)
    group = ProtectionGroup(
        group_cpu.geometry,
        PageTable.from_rows(data),
        PageTable.from_rows(parity[:8]).mapped_into("cuda:0"),
        PageTable.from_rows(parity[8:]).mapped_into("cuda:0"),
        name="host-parity",
    )
    assert group.first_tier_codec.backend == "triton"
    group.encode()
    torch.cuda.synchronize()
    np.testing.assert_array_equal(parity.numpy(), truth[40:])
    data[[0, 7, 39]] = 0
    parity[3] = 0  # a first-tier page, rebuilt from the second tier
    group.reconstruct([0, 7, 39, 43])
    torch.cuda.synchronize()
    np.testing.assert_array_equal(data.cpu().numpy(), truth[:40])
    np.testing.assert_array_equal(parity.numpy(), truth[40:])


def test_auto_falls_back_when_the_native_kernel_is_unavailable(monkeypatch):
    from unbroken.erasure import backends

    real = backends._build

    def no_native(backend, *args):
        if backend == "native":
            raise backends.BackendUnavailableError("no compiler here")
        return real(backend, *args)

    monkeypatch.setattr(backends, "_build", no_native)
    assert backends.get_codec(4, 2).backend in ("isal", "numpy")
    assert "no compiler here" in backends.available_backends()["native"]


@pytest.mark.slow
def test_default_geometry_full_size_group_survives_16_lost_pages_and_a_tier1_page():
    geometry = ErasureGeometry()  # 240 x 2 MiB data, 16 + 1 parity pages
    rng = np.random.default_rng(2)
    pages = rng.integers(0, 256, (geometry.total_pages, geometry.page_bytes), dtype=np.uint8)
    d, h1 = geometry.data_pages, geometry.parity_pages
    table = PageTable.from_rows(pages)
    group = ProtectionGroup(
        geometry,
        table.take(range(d)),
        table.take(range(d, d + h1)),
        table.take(range(d + h1, d + h1 + 1)),
        name="full",
    )
    group.encode()
    truth = pages.copy()
    lost = [*sorted(rng.choice(d, 16, replace=False).tolist()), d + 3]
    pages[lost] = 0
    group.reconstruct(lost)
    np.testing.assert_array_equal(pages, truth)
