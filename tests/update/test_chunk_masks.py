"""`ChunkStep`'s per-chunk masks from element ranges: interval arithmetic over a chunk's rows
gives exactly the per-element membership, collapsed to True / False when uniform."""

from __future__ import annotations

import random

import torch

from unbroken.update import StateGeometry
from unbroken.update.kernel import _ranges_mask


def _brute(geo: StateGeometry, ref, ranges) -> torch.Tensor:
    rows = geo.row_intervals(ref)
    idx = torch.tensor([list(range(lo, hi)) for lo, hi in rows])
    out = torch.zeros_like(idx, dtype=torch.bool)
    for a, b in ranges:
        out |= (idx >= a) & (idx < b)
    return out


def _random_ranges(rng: random.Random, n: int) -> list[tuple[int, int]]:
    cuts = sorted(rng.sample(range(n + 1), 2 * rng.randint(1, 6)))
    return [(cuts[i], cuts[i + 1]) for i in range(0, len(cuts), 2)]


def test_masks_equal_per_element_membership_for_random_ranges():
    geo = StateGeometry(numel=6000, page_bytes=1024, stripe_pages=3, chunk_bytes=256)
    rng = random.Random(7)
    kinds = set()
    for _ in range(60):
        ranges = _random_ranges(rng, geo.padded_numel)
        for ref in geo.chunks():
            want = _brute(geo, ref, ranges)
            got = _ranges_mask(geo.row_intervals(ref), ranges)
            if isinstance(got, bool):
                kinds.add(got)
                assert bool(want.all()) if got else not bool(want.any())
            else:
                kinds.add("mixed")
                assert got.shape == want.shape and torch.equal(got, want)
                assert bool(got.any()) and not bool(got.all())
    assert kinds == {True, False, "mixed"}  # every outcome was exercised


def test_no_ranges_and_a_range_covering_everything():
    geo = StateGeometry(numel=2048, page_bytes=1024, stripe_pages=2, chunk_bytes=512)
    for ref in geo.chunks():
        assert _ranges_mask(geo.row_intervals(ref), ()) is False
        assert _ranges_mask(geo.row_intervals(ref), ((0, geo.padded_numel),)) is True
