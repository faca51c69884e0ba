"""Retained GPU memory (CUDA virtual-memory allocations, one per page, owned by the state
manager): data outlive a trainer killed with SIGKILL and come back in a new process, bit for
bit; a lost page is found and given new memory alone; the manager holds no file descriptor per
page, so one manager and its trainer retain 100 GB (51,200 pages) under the H200 machine's
20,000-fd limit; without a GPU the manager refuses the request with a clear error and keeps
serving."""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from unbroken.state import RetainedClient, RetainedStateError

from .conftest import manager_env

MIB2 = 2 << 20

WRITER = textwrap.dedent(
    """
    import os, signal, sys, torch
    from unbroken.state import RetainedClient
    client = RetainedClient(sys.argv[1])
    region = client.allocate("model", 3 * 2 * 2**20, page_bytes=2 * 2**20, protected=True,
                             device=0)
    assert region.fresh and region.tensor.is_cuda, region
    gen = torch.Generator(device="cuda").manual_seed(1234)
    region.tensor.copy_(torch.randint(0, 256, (region.nbytes,), generator=gen,
                                      dtype=torch.uint8, device="cuda"))
    torch.cuda.synchronize()
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def _cuda_vmm() -> bool:
    from unbroken.state import cuda_vmm

    return torch.cuda.is_available() and cuda_vmm.available()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_region_survives_sigkill_of_the_writer(manager):
    assert _cuda_vmm(), "a CUDA device without the driver's virtual-memory API (cuda-python)"
    proc = subprocess.run(
        [sys.executable, "-c", WRITER, str(manager[1])], env=manager_env(), timeout=120
    )
    assert proc.returncode == -signal.SIGKILL
    gen = torch.Generator(device="cuda").manual_seed(1234)
    expected = torch.randint(0, 256, (3 * MIB2,), generator=gen, dtype=torch.uint8, device="cuda")
    with RetainedClient(manager[1]) as client:
        region = client.allocate("model", 3 * MIB2, page_bytes=MIB2, protected=True, device=0)
        assert not region.fresh and region.device == 0
        assert torch.equal(region.tensor, expected)
        assert client.localize().lost == {"model": []}
        region.tensor.zero_()  # a write through the new mapping reaches the same memory
        torch.cuda.synchronize()
    with RetainedClient(manager[1]) as client:
        region = client.attach("model")
        assert int(region.tensor.count_nonzero()) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_lost_gpu_page_is_localized_and_remapped_alone(manager):
    pattern = torch.arange(4 * MIB2, device="cuda", dtype=torch.int64).to(torch.uint8)
    with RetainedClient(manager[1]) as client:
        region = client.allocate("model", 4 * MIB2, page_bytes=MIB2, protected=True, device=0)
        region.tensor.copy_(pattern)
        client.discard("model", [1])  # the manager's reference ...
        region.unmap_pages([1])  # ... and ours: the driver frees the page
    with RetainedClient(manager[1]) as client:
        assert client.list()[0]["missing"] == [1]
        region = client.attach("model")  # maps pages 0, 2, 3 only; nothing touched yet
        assert client.localize().lost == {"model": [1]}
        client.remap("model", [1])
        assert client.localize().lost == {"model": []}
        keep = torch.ones(4 * MIB2, dtype=torch.bool, device="cuda")
        keep[MIB2 : 2 * MIB2] = False
        assert torch.equal(region.tensor[keep], pattern[keep])  # the other pages intact
        region.page(1).fill_(7)  # the new page is real, writable memory
        assert int((region.page(1) == 7).sum()) == MIB2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_premapped_gpu_region_drops_a_page_lost_since_and_maps_its_new_memory(manager):
    """A shadow premaps; the trainer then loses page 1 (both its references dropped). The
    shadow's mapping alone holds that memory: promoted, its `allocate` unmaps the page (the
    memory is gone), localization finds it lost, the remap maps a new page there; the other
    pages are the same mappings, the trainer's bytes in them."""
    pattern = torch.arange(4 * MIB2, device="cuda", dtype=torch.int64).to(torch.uint8)
    with RetainedClient(manager[1], generation=0) as trainer, RetainedClient(manager[1]) as shadow:
        region = trainer.allocate("model", 4 * MIB2, page_bytes=MIB2, protected=True, device=0)
        region.tensor.copy_(pattern)
        torch.cuda.synchronize()
        (premapped,) = shadow.premap()
        assert premapped.mapped_pages() == [0, 1, 2, 3]
        trainer.discard("model", [1])
        region.unmap_pages([1])
        shadow.generation = 1
        taken = shadow.allocate("model", 4 * MIB2, page_bytes=MIB2, protected=True, device=0)
        assert taken is premapped and taken.mapped_pages() == [0, 2, 3]
        assert shadow.localize().lost == {"model": [1]}
        shadow.remap("model", [1])
        assert taken.mapped_pages() == [0, 1, 2, 3]
        assert shadow.attach("model") is taken  # its own remap: its mapping has the new page
        keep = torch.ones(4 * MIB2, dtype=torch.bool, device="cuda")
        keep[MIB2 : 2 * MIB2] = False
        assert torch.equal(taken.tensor[keep], pattern[keep])
        taken.page(1).fill_(7)
        torch.cuda.synchronize()
    # A mapping made before that remap holds the lost page's old allocation: a client that
    # premapped then is given the region mapped anew, with the new page.
    with RetainedClient(manager[1]) as late:
        region = late.attach("model")
        assert int((region.page(1) == 7).sum()) == MIB2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_premapping_made_before_a_remap_is_not_reused(manager):
    with RetainedClient(manager[1]) as trainer, RetainedClient(manager[1]) as shadow:
        region = trainer.allocate("model", 2 * MIB2, page_bytes=MIB2, protected=True, device=0)
        (premapped,) = shadow.premap()
        trainer.discard("model", [0])
        region.unmap_pages([0])
        trainer.remap("model", [0])  # (a trainer repaired it after the shadow had mapped)
        region.page(0).fill_(3)
        torch.cuda.synchronize()
        taken = shadow.attach("model")
        assert taken is not premapped and int((taken.page(0) == 3).sum()) == MIB2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_premapped_region_of_most_of_the_gpu_can_be_replaced(manager):
    """A promoted shadow restarting under another plan replaces a premapped region: its
    mapping goes before the manager makes the new one, or the GPU would hold both (here 60 %
    of its free memory each: the new one could not be made)."""
    free, _ = torch.cuda.mem_get_info()
    pages = int(free * 0.6) // MIB2
    with RetainedClient(manager[1]) as trainer, RetainedClient(manager[1]) as shadow:
        trainer.allocate("model", pages * MIB2, page_bytes=MIB2, protected=True, device=0)
        trainer.close()
        (old,) = shadow.premap()
        new = shadow.allocate(
            "model", (pages - 1) * MIB2, page_bytes=MIB2, protected=True, device=0, replace=True
        )
        assert new is not old and new.fresh and new.n_pages == pages - 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_page_size_off_the_granularity_is_refused(client):
    with pytest.raises(RetainedStateError, match="granularity"):
        client.allocate("model", 3 * 65536, page_bytes=65536, protected=True, device=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU answer")
def test_gpu_region_without_a_gpu_is_refused_clearly(client):
    with pytest.raises(RetainedStateError, match=r"region 'model' on cuda:0"):
        client.allocate("model", 2 * MIB2, page_bytes=MIB2, protected=True, device=0)
    host = client.allocate("grads", 65536, page_bytes=65536, protected=False)  # still serving
    assert host.device is None and host.fresh


def test_export_of_a_host_region_is_refused(client):
    client.allocate("grads", 65536, page_bytes=65536, protected=False)
    with pytest.raises(RetainedStateError, match="host memory"):
        client._call("export", name="grads", pages=[0])  # GPU pages only; a memfd comes whole
    assert client.list()[0]["name"] == "grads"  # still serving


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _held_fds(pid: int) -> int:
    """The manager's open fds but its sockets: the page fds it keeps. A client's connection
    stays open in the manager until its loop reads the client's close, which may come after
    the client returned."""
    root = f"/proc/{pid}/fd"
    links = []
    for name in os.listdir(root):
        with contextlib.suppress(FileNotFoundError):
            links.append(os.readlink(f"{root}/{name}"))
    return sum(not link.startswith("socket:") for link in links)


# Fill and check 100 GB in slices of 1 GiB: a pattern from each int64's index, so no second copy
# of the data is needed to compare against.
FILL_100GB = textwrap.dedent(
    """
    import os, signal, sys, time, torch
    from unbroken.state import RetainedClient
    GIB, N, PER = 2**30, int(sys.argv[2]), int(sys.argv[3])
    client = RetainedClient(sys.argv[1], timeout_s=600)
    start = time.perf_counter()
    regions = [client.allocate(f"r{i}", PER * GIB, page_bytes=2 * 2**20, protected=True,
                               device=0) for i in range(N)]
    print(f"allocate {time.perf_counter() - start:.2f} s", flush=True)
    for i, region in enumerate(regions):
        words = region.view(torch.int64)
        for at in range(0, words.numel(), GIB // 8):
            n = min(GIB // 8, words.numel() - at)
            idx = torch.arange(at, at + n, device="cuda", dtype=torch.int64)
            words[at : at + n] = idx * 6364136223846793005 + i
    torch.cuda.synchronize()
    print(f"fds {len(os.listdir('/proc/self/fd'))}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_100_gb_retained_by_one_manager_survive_sigkill_of_the_trainer(manager):
    """Four regions of 25 GiB (107 GB, 51,200 pages of 2 MiB): written by a trainer that is then
    killed, attached by the next one bit for bit; neither the manager nor a trainer holds an fd
    per page, so the 20,000-fd limit of the H200 machine does not cap retention."""
    n, per = 4, 25
    total = n * per * 2**30
    assert total >= 100e9
    free, _ = torch.cuda.mem_get_info()
    assert free > total + (4 << 30), (
        f"needs {total / 1e9:.0f} GB free on the GPU, has {free / 1e9:.0f}"
    )
    proc, path = manager
    writer = subprocess.run(
        [sys.executable, "-c", FILL_100GB, str(path), str(n), str(per)],
        env=manager_env(),
        timeout=600,
        capture_output=True,
        text=True,
    )
    assert writer.returncode == -signal.SIGKILL, writer.stderr
    writer_fds = int(writer.stdout.split("fds ")[1].split()[0])
    assert writer_fds < 1000, writer.stdout  # no fd per page in the trainer
    # Nor in the manager, which holds all 51,200 pages: it keeps exported fds for reuse only up
    # to its budget (half the open-file limit), beside its socket and the driver's files.
    limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    assert _fds(proc.pid) <= min(limit // 2, total // MIB2) + 100
    start = time.perf_counter()
    with RetainedClient(path, timeout_s=600) as client:
        regions = [client.attach(f"r{i}") for i in range(n)]
        attach_s = time.perf_counter() - start
        assert sum(r.nbytes for r in regions) == total
        assert sum(r.n_pages for r in regions) == total // MIB2
        for i, region in enumerate(regions):
            words = region.view(torch.int64)
            for at in range(0, words.numel(), 2**27):
                m = min(2**27, words.numel() - at)
                idx = torch.arange(at, at + m, device="cuda", dtype=torch.int64)
                assert torch.equal(words[at : at + m], idx * 6364136223846793005 + i), (i, at)
    print(
        f"retained {total / 1e9:.1f} GB in {total // MIB2} pages; {writer.stdout.splitlines()[0]};"
        f" attach {attach_s:.2f} s (manager's export {client.export_ms / 1e3:.2f} s);"
        f" fd limit {limit}; manager fds {_fds(proc.pid)}"
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_pages_past_the_fd_budget_are_exported_per_attach_and_lost_pages_drop_their_kept_fd(
    spawn_manager,
):
    """A manager keeping at most 8 exported fds: a 12-page region attaches whole (8 pages from
    kept fds, 4 exported for the reply and closed after it); a discarded page, kept or not, is
    lost for real and remaps."""
    proc, path = spawn_manager(extra=("--fd-budget", "8"))
    pattern = torch.arange(12 * MIB2, device="cuda", dtype=torch.int64).to(torch.uint8)
    with RetainedClient(path) as client:
        region = client.allocate("model", 12 * MIB2, page_bytes=MIB2, protected=True, device=0)
        region.tensor.copy_(pattern)
        torch.cuda.synchronize()
    held = _held_fds(proc.pid)
    for _ in range(3):  # attaches past the budget leave no fd behind
        with RetainedClient(path) as client:
            assert torch.equal(client.attach("model").tensor, pattern)
    assert _held_fds(proc.pid) == held
    with RetainedClient(path) as client:
        region = client.attach("model")
        client.discard("model", [2, 10])  # page 2's fd was kept, page 10's was not
        region.unmap_pages([2, 10])
    assert _held_fds(proc.pid) == held - 1  # the kept fd went with its page
    with RetainedClient(path) as client:
        assert client.localize().lost == {"model": [2, 10]}
        client.attach("model")
        client.remap("model", [2, 10])
        assert client.localize().lost == {"model": []}
