"""The ISA-L baseline: both update methods and both delta paths are byte-exact, and the
benchmark calibrates and reports ISA-L's slice sizes per operation."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from unbroken.erasure import PageTable, get_codec, isal_backend

pytestmark = pytest.mark.ci_required  # pyeclib (ISA-L) is in the `bench` extra ./dev installs


@pytest.fixture(scope="module", autouse=True)
def _need_isal():
    try:
        isal_backend.load_isal()
    except isal_backend.IsalUnavailableError as exc:
        pytest.skip(str(exc))


def _reference_update(k, m, parity, old, new, offset):
    expect = parity.copy()
    get_codec(k, m, backend="numpy").update_from_old_new(
        [*expect], dict(enumerate(old)), dict(enumerate(new)), offset=offset
    )
    return expect


@pytest.mark.parametrize("method", isal_backend.UPDATE_METHODS)
@pytest.mark.parametrize("layout", ["rows", "scattered"])
def test_fused_update_is_byte_exact(method, layout):
    k, m, length, offset = 13, 5, 1000, 24
    rng = np.random.default_rng(7)
    old = rng.integers(0, 256, (k, length), dtype=np.uint8)
    new = rng.integers(0, 256, (k, length), dtype=np.uint8)
    parity = rng.integers(0, 256, (m, length + 40), dtype=np.uint8)
    expect = _reference_update(k, m, parity, old, new, offset)
    codec = isal_backend.IsalCodec(k, m, slice_bytes=96, update_method=method)  # 96 ∤ 1000
    tables = [
        _scattered(x) if layout == "scattered" else PageTable.from_rows(x)
        for x in (parity, old, new)
    ]
    codec.update_from_old_new(*tables, offset=offset)
    np.testing.assert_array_equal(np.stack(tables[0].numpy_views()), expect)


def _scattered(rows: np.ndarray) -> PageTable:
    """The rows copied into one buffer at unevenly spaced offsets (the per-page path)."""
    count, length = rows.shape
    starts = [i * (length + 64) + (i * i % 7) * 8 for i in range(count)]
    backing = np.zeros(starts[-1] + length, dtype=np.uint8)
    pages = [backing[s : s + length] for s in starts]
    for page, row in zip(pages, rows, strict=True):
        page[:] = row
    table = PageTable(pages)
    assert isal_backend._rows_view(table, length) is None
    return table


def test_rows_view_only_for_evenly_spaced_ascending_pages():
    rows = np.zeros((4, 64), dtype=np.uint8)
    table = PageTable.from_rows(rows)
    assert isal_backend._rows_view(table, 64).shape == (4, 64)
    assert isal_backend._rows_view(table.take([3, 2, 1, 0]), 64) is None
    assert isal_backend._rows_view(table.take([0, 1, 3]), 64) is None


def test_unknown_update_method_is_rejected():
    with pytest.raises(ValueError, match="update_method"):
        isal_backend.IsalCodec(4, 2, update_method="fast")


def test_bench_reports_each_operations_isal_slice(capsys):
    from unbroken.bench import erasure as bench_erasure

    parser = argparse.ArgumentParser()
    bench_erasure.add_arguments(parser)
    flags = "--json --data-pages 6 --parity-pages 3 --block-kib 32 --repeat 1"
    args = parser.parse_args(flags.split(" "))
    assert bench_erasure.run(args) == 0
    (result,) = json.loads(capsys.readouterr().out)["results"]
    candidates = {*bench_erasure.ISAL_SLICE_CANDIDATES, 32 * 1024}
    assert result["isal_encode_slice_bytes"] in candidates
    assert result["isal_update_slice_bytes"] in candidates
    assert result["isal_update_method"] in isal_backend.UPDATE_METHODS
    assert result["isal_encode_gbps"] > 0 and result["isal_update_gbps"] > 0
