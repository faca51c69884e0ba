"""Localization finds exactly the lost pages through the memory; remap makes them usable."""

from __future__ import annotations

import ctypes
import mmap
import os
import random
import time
from pathlib import Path

import pytest
import torch

from unbroken.state import punch_pages
from unbroken.state._syscalls import MADV_HWPOISON, madvise_range, memory_failure_supported
from unbroken.state.localize import bisect_failed_pages, hole_pages, poisoned_pages
from unbroken.state.pool import RetainedPool

PAGE = 64 * 1024


@pytest.mark.parametrize("seed", range(4))
def test_localize_finds_exactly_the_punched_pages_and_remap_heals(client, seed):
    rng = random.Random(seed)
    model = client.allocate("model", 64 * PAGE, page_bytes=PAGE, protected=True)
    parity = client.allocate("grad_parity", 16 * PAGE, page_bytes=PAGE, protected=True)
    for region in (model, parity):
        region.tensor.copy_(torch.randint(1, 256, (region.nbytes,), dtype=torch.uint8))
    before = model.tensor.clone()
    lost_model = sorted(rng.sample(range(64), rng.randint(1, 20)))
    lost_parity = sorted(rng.sample(range(16), rng.randint(0, 3)))
    punch_pages(model, lost_model)
    punch_pages(parity, lost_parity)

    t0 = time.perf_counter()
    report = client.localize()  # the manager knows nothing of the injection
    round_trip_ms = (time.perf_counter() - t0) * 1e3
    assert report.lost == {"model": lost_model, "grad_parity": lost_parity}
    assert report.total == len(lost_model) + len(lost_parity)
    assert 0 < report.ms <= round_trip_ms  # the manager's own time, inside the request's

    assert not bool(model.page(lost_model[0]).any())  # real loss: the bytes are gone
    kept = [p for p in range(64) if p not in lost_model]
    for p in kept:  # survivors are intact (reading them is fine: they are not holes)
        assert torch.equal(model.page(p), before[p * PAGE : (p + 1) * PAGE])

    t0 = time.perf_counter()
    remap_ms = client.remap("model", lost_model)
    assert 0 < remap_ms <= (time.perf_counter() - t0) * 1e3
    client.remap("grad_parity", lost_parity)
    assert client.localize().lost == {"model": [], "grad_parity": []}
    for p in lost_model:  # healthy zeroed memory, writable, the write is shared
        assert not bool(model.page(p).any())
        model.page(p).copy_(before[p * PAGE : (p + 1) * PAGE])
    assert torch.equal(client.attach("model").tensor, before)
    assert client.localize(["model"]).lost == {"model": []}


def test_hole_pages_rounds_partial_holes_to_pages():
    fd = os.memfd_create("t")
    try:
        os.ftruncate(fd, 8 * PAGE)
        os.pwrite(fd, b"\1" * (8 * PAGE), 0)
        from unbroken.state._syscalls import FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE, fallocate

        fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, PAGE + 4096, 4096)
        fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 6 * PAGE, 2 * PAGE)
        assert hole_pages(fd, 8 * PAGE, PAGE) == [1, 6, 7]
    finally:
        os.close(fd)


def test_bisection_finds_every_failed_page_with_few_probes():
    failed = {3, 4, 40, 63}
    probes = []

    def range_fails(start: int, n: int) -> bool:
        probes.append((start, n))
        return any(start <= p < start + n for p in failed)

    assert bisect_failed_pages(0, 64, range_fails) == sorted(failed)
    assert len(probes) < 64
    assert bisect_failed_pages(0, 64, lambda s, n: False) == []


def test_poison_probe_matches_the_kernel_config():
    compiled_in = Path("/proc/sys/vm/memory_failure_recovery").exists()
    assert memory_failure_supported() == compiled_in


def test_poison_scan_never_refills_holes():
    # The madvise scan runs even where nothing can be poisoned; it must skip known holes.
    pool = RetainedPool(detect_poison=True)
    try:
        region, _ = pool.allocate("model", 16 * PAGE, PAGE, True)
        os.pwrite(region.fd, b"\1" * region.nbytes, 0)
        punch_pages(region, [2, 9])
        assert pool.localize()[0] == {"model": [2, 9]}
        assert pool.localize()[0] == {"model": [2, 9]}  # still holes: nothing touched them
        pool.remap("model", [2, 9])
        assert pool.localize()[0] == {"model": []}
    finally:
        pool.close()


HWPOISON_OPT_IN = "UNBROKEN_HWPOISON_TEST"


def test_a_hardware_poisoned_page_is_found_by_the_pool():
    """A page really poisoned by the kernel (`MADV_HWPOISON`, as a memory error would) is
    found by the pool's localization and by the madvise scan. It takes a physical page of the
    host out of service until reboot, so it runs only where asked to; the CI kernel cannot
    poison pages at all (CONFIG_MEMORY_FAILURE is off), so there the punched-hole tests above
    are the real loss."""
    if not memory_failure_supported():
        pytest.skip("kernel without memory-failure support: MADV_HWPOISON cannot poison pages")
    if os.getuid() != 0:
        pytest.skip("MADV_HWPOISON needs CAP_SYS_ADMIN")
    if os.environ.get(HWPOISON_OPT_IN) != "1":
        pytest.skip(f"poisons a physical page of this host for good; opt in: {HWPOISON_OPT_IN}=1")
    pool = RetainedPool(detect_poison=True)
    try:
        region, _ = pool.allocate("model", 16 * PAGE, PAGE, True)
        os.pwrite(region.fd, b"\1" * region.nbytes, 0)
        mapping = mmap.mmap(region.fd, region.nbytes, mmap.MAP_SHARED)
        anchor = ctypes.c_char.from_buffer(mapping)
        try:
            victim = ctypes.addressof(anchor) + 5 * PAGE + 3 * mmap.PAGESIZE
            assert madvise_range(victim, mmap.PAGESIZE, MADV_HWPOISON) == 0
        finally:
            del anchor
            mapping.close()
        assert pool.localize()[0] == {"model": [5]}
        holes = hole_pages(region.fd, region.nbytes, PAGE)  # a kernel may drop the page
        assert sorted({*holes, *poisoned_pages(region.fd, region.nbytes, PAGE, holes)}) == [5]
    finally:
        pool.close()
