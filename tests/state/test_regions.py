"""Allocation, attach, zero-copy mapping and region bookkeeping through a real manager."""

from __future__ import annotations

import ctypes
import os
import stat

import pytest
import torch

from unbroken.state import RetainedClient, RetainedStateError
from unbroken.state.localize import hole_pages

PAGE = 64 * 1024


def test_allocate_and_attach_share_bytes_zero_copy(manager, client):
    region = client.allocate("model", 10 * PAGE, page_bytes=PAGE, protected=True)
    assert region.fresh and region.nbytes == 10 * PAGE and region.n_pages == 10
    address = ctypes.addressof(ctypes.c_char.from_buffer(region._mmap))
    assert region.tensor.data_ptr() == address
    assert region.tensor.dtype == torch.uint8 and region.tensor.numel() == 10 * PAGE

    region.view(torch.float32).copy_(torch.arange(10 * PAGE // 4, dtype=torch.float32))
    with RetainedClient(manager[1]) as other:
        seen = other.attach("model")
        assert not seen.fresh and seen.protected
        assert torch.equal(seen.view(torch.float32)[:5], torch.arange(5, dtype=torch.float32))
        seen.page(3).fill_(7)  # a write in one process is visible in the other
    assert bool((region.page(3) == 7).all())
    assert region.page(3).data_ptr() == address + 3 * PAGE
    with pytest.raises(IndexError):
        region.page(10)


def test_size_rounds_up_and_reallocate_reuses(client):
    region = client.allocate("grads", PAGE + 1, page_bytes=PAGE, protected=False)
    assert region.nbytes == 2 * PAGE
    again = client.allocate("grads", 2 * PAGE, page_bytes=PAGE, protected=False)
    assert again is region and not again.fresh  # mapped once per region
    with pytest.raises(RetainedStateError, match="free it before"):
        client.allocate("grads", 4 * PAGE, page_bytes=PAGE, protected=False)
    assert client.list() == [
        {
            "name": "grads",
            "nbytes": 2 * PAGE,
            "page_bytes": PAGE,
            "protected": False,
            "device": None,
            "serial": 1,
        }
    ]
    client.free("grads")
    assert client.list() == []
    fresh = client.allocate("grads", 2 * PAGE, page_bytes=PAGE, protected=False)
    assert fresh.fresh and fresh is not region


def test_replace_remakes_a_region_of_another_geometry_and_keeps_one_of_the_same(client):
    kept = client.allocate("model", 2 * PAGE, page_bytes=PAGE, protected=True)
    kept.page(0).fill_(5)
    same = client.allocate("model", 2 * PAGE, page_bytes=PAGE, protected=True, replace=True)
    assert same is kept and not same.fresh and bool((same.page(0) == 5).all())
    other = client.allocate("model", 3 * PAGE, page_bytes=PAGE, protected=True, replace=True)
    assert other.fresh and other.nbytes == 3 * PAGE  # another plan's size: made anew, zeroed
    assert int(other.tensor.count_nonzero()) == 0
    assert [(r["name"], r["nbytes"], r["serial"]) for r in client.list()] == [
        ("model", 3 * PAGE, 2)
    ]
    with pytest.raises(RetainedStateError, match="replace must be a bool"):
        client._call(
            "allocate", name="x", nbytes=PAGE, page_bytes=PAGE, protected=True, replace="yes"
        )


def test_a_fresh_region_is_backed_before_anyone_writes_it(client):
    """A trainer killed between allocating a region and writing it must leave a region that
    reads as never written (zeros), not one whose pages localization reports lost."""
    region = client.allocate("scratch", 8 * PAGE, page_bytes=PAGE, protected=False)
    assert region.fresh
    assert hole_pages(region.fd, region.nbytes, PAGE) == []
    assert os.lseek(region.fd, 0, os.SEEK_HOLE) == region.nbytes
    assert client.localize(["scratch"]).lost == {"scratch": []}
    assert int(region.tensor.count_nonzero()) == 0


def test_attach_unknown_region_is_an_error(client):
    with pytest.raises(RetainedStateError, match="no region named 'undo'"):
        client.attach("undo")


def test_socket_is_private(manager):
    mode = os.stat(manager[1]).st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600


def test_discard_is_for_gpu_regions_only(client):
    client.allocate("grads", 2 * PAGE, page_bytes=PAGE, protected=False).tensor.fill_(1)
    with pytest.raises(RetainedStateError, match="discard covers GPU regions only"):
        client.discard("grads", [0])
    assert client.localize().lost == {"grads": []}  # refused without side effects


def test_a_client_of_an_older_generation_is_refused_once_a_newer_one_was_served(manager):
    """Fencing at the state: a trainer of a generation being torn down (a hung one that wakes
    up, one on a node partitioned away and back) cannot touch what its successor uses."""
    with (
        RetainedClient(manager[1], generation=3) as old,
        RetainedClient(manager[1], generation=4) as new,
        RetainedClient(manager[1]) as agent,
    ):
        old.allocate("model", 4 * PAGE, page_bytes=PAGE, protected=True)
        assert not new.attach("model").fresh  # the successor takes the state over
        with pytest.raises(RetainedStateError, match="stale generation 3: generation 4"):
            old.localize()
        with pytest.raises(RetainedStateError, match="stale generation 3"):
            old.free("model")
        assert new.localize().lost == {"model": []}  # the successor is still served
        assert [r["name"] for r in agent.list()] == ["model"]  # no generation: served


def test_a_premapped_region_is_the_one_its_next_trainer_allocates(manager):
    """A parked shadow maps the regions while the trainer works (no generation: the trainer is
    still served), then, promoted, allocates them: the same mappings, no new one, the trainer's
    bytes in them, and the old trainer fenced from here."""
    with (
        RetainedClient(manager[1], generation=0) as trainer,
        RetainedClient(manager[1]) as shadow,
    ):
        model = trainer.allocate("model", 4 * PAGE, page_bytes=PAGE, protected=True)
        trainer.allocate("marker", PAGE, page_bytes=PAGE, protected=True)
        premapped = {r.name: r for r in shadow.premap()}
        assert set(premapped) == {"model", "marker"} and shadow.mapped() == premapped
        assert trainer.localize().lost == {"model": [], "marker": []}  # not fenced by it
        model.page(2).fill_(9)  # the trainer writes on after the shadow mapped
        shadow.generation = 1
        taken = shadow.allocate("model", 4 * PAGE, page_bytes=PAGE, protected=True)
        assert taken is premapped["model"] and not taken.fresh
        assert bool((taken.page(2) == 9).all())
        with pytest.raises(RetainedStateError, match="stale generation 0"):
            trainer.localize()


def test_replacing_a_premapped_region_maps_the_new_one_and_drops_the_old(manager):
    """(That the old is unmapped before the manager makes the new one shows on a GPU: a region
    of most of its memory replaced, `test_gpu_regions`.)"""
    with RetainedClient(manager[1]) as trainer, RetainedClient(manager[1]) as shadow:
        trainer.allocate("model", 2 * PAGE, page_bytes=PAGE, protected=True)
        (old,) = shadow.premap()
        new = shadow.allocate("model", 3 * PAGE, page_bytes=PAGE, protected=True, replace=True)
        assert new is not old and new.fresh and new.nbytes == 3 * PAGE
        assert old.tensor is None
        assert shadow.mapped() == {"model": new}
