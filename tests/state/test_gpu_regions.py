"""Retained GPU memory (CUDA virtual-memory allocations, one per page, owned by the state
manager): data outlive a trainer killed with SIGKILL and come back in a new process, bit for
bit; a lost page is found and given new memory alone; without a GPU the manager refuses the
request with a clear error and keeps serving."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

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
def test_gpu_page_size_off_the_granularity_is_refused(client):
    with pytest.raises(RetainedStateError, match="granularity"):
        client.allocate("model", 3 * 65536, page_bytes=65536, protected=True, device=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU answer")
def test_gpu_region_without_a_gpu_is_refused_clearly(client):
    with pytest.raises(RetainedStateError, match=r"region 'model' on cuda:0"):
        client.allocate("model", 2 * MIB2, page_bytes=MIB2, protected=True, device=0)
    host = client.allocate("grads", 65536, page_bytes=65536, protected=False)  # still serving
    assert host.device is None and host.fresh
