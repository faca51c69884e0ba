"""`RetainedLayout`, the one owner of the retained layout: sizes, group membership and the
page -> group mapping agree with each other and with what the updater protects."""

from __future__ import annotations

import pytest

from unbroken.config import ProtectionConfig
from unbroken.update.geometry import StateGeometry
from unbroken.update.layout import MARKER_PAGE, RetainedLayout

PROT = ProtectionConfig(page_bytes=4096, stripe_pages=2, parity_pages=3, chunk_bytes=1024)


def _layout(numel: int = 10_000) -> RetainedLayout:
    geometry = StateGeometry(numel=numel, page_bytes=4096, stripe_pages=2, chunk_bytes=1024)
    return RetainedLayout.of(geometry, PROT)


def test_region_sizes_follow_the_geometry():
    layout = _layout()
    g = layout.geometry
    sizes = {r.name: r.nbytes for r in layout.regions()}
    assert sizes["model"] == 3 * g.padded_numel * 4
    assert sizes["grads"] == g.padded_numel * 4
    assert sizes["model_parity"] == sizes["grad_parity"] == g.groups * (3 + 1) * 4096
    assert sizes["marker"] == 3 * MARKER_PAGE
    assert sizes["undo"] == 3 * 2 * 1024
    assert sizes["scratch"] == 2 * (3 + 1) * 1024  # two staging slots
    assert [r.protected for r in layout.regions()] == [True] * 5 + [False] * 2


@pytest.mark.parametrize("kind", ["model", "grads"])
def test_every_protected_page_is_in_exactly_one_group_and_maps_back(kind):
    layout = _layout()
    pages_in_region = (3 if kind == "model" else 1) * layout.geometry.segment_pages
    seen: dict[int, tuple[int, int]] = {}
    for group in range(layout.groups):
        rows = layout.group_rows(kind, group)
        assert len(rows) == layout.data_pages(kind) == layout.erasure(kind).data_pages
        for pos, page in enumerate(rows):
            assert page not in seen
            seen[page] = (group, pos)
    assert sorted(seen) == list(range(pages_in_region))
    for page, (group, pos) in seen.items():
        assert layout.lost_by_group(kind, [page], []) == {group: {pos}}


def test_parity_pages_map_to_their_group_and_tier_position():
    layout = _layout()
    d = layout.data_pages("model")
    for group in range(layout.groups):
        first, second = layout.parity_rows(group, 1), layout.parity_rows(group, 2)
        assert len(first) == 3 and len(second) == 1
        assert layout.lost_by_group("model", [], first + second) == {group: set(range(d, d + 4))}


def test_pages_past_the_segments_and_groups_belong_to_no_group():
    layout = _layout()
    seg = layout.geometry.segment_pages
    assert layout.lost_by_group("grads", [seg], []) == {}  # past the gradient segment
    assert layout.lost_by_group("model", [], [layout.groups * layout.width]) == {}


def test_a_local_allocator_holds_every_region_of_the_layout_in_this_process():
    from unbroken.update.rmu import local_allocator

    from ..optim._rig import PROT as RIG_PROT
    from ..optim._rig import built

    regions: dict = {}
    b = built("adamw", allocate=local_allocator(RIG_PROT, regions))
    specs = RetainedLayout.of(b.geometry, RIG_PROT).regions()
    assert {s.name: s.nbytes for s in specs} == {n: r.numel() for n, r in regions.items()}
    assert {r.device.type for r in regions.values()} == {"cpu"}
    # The state's buffers are views of the retained model and grads regions.
    n = b.geometry.padded_numel
    assert b.state.params.data_ptr() == regions["model"].data_ptr()
    assert b.state.grads.data_ptr() == regions["grads"].data_ptr()
    assert b.state.params.numel() == n
