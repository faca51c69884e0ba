"""Retained data outlive a trainer killed with SIGKILL; the manager outlives its clients only
while its parent lives."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import torch

from unbroken.state import RetainedClient

from .conftest import manager_env, wait_pid_exit

PAGE = 64 * 1024

WRITER = textwrap.dedent(
    """
    import os, signal, sys, torch
    from unbroken.state import RetainedClient
    client = RetainedClient(sys.argv[1])
    region = client.allocate("model", 16 * 65536, page_bytes=65536, protected=True)
    assert region.fresh
    gen = torch.Generator().manual_seed(1234)
    region.tensor.copy_(torch.randint(0, 256, (region.nbytes,), generator=gen, dtype=torch.uint8))
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def test_data_survive_sigkill_of_the_writer(manager):
    proc = subprocess.run(
        [sys.executable, "-c", WRITER, str(manager[1])], env=manager_env(), timeout=60
    )
    assert proc.returncode == -signal.SIGKILL
    gen = torch.Generator().manual_seed(1234)
    expected = torch.randint(0, 256, (16 * PAGE,), generator=gen, dtype=torch.uint8)
    with RetainedClient(manager[1]) as client:
        region = client.allocate("model", 16 * PAGE, page_bytes=PAGE, protected=True)
        assert not region.fresh
        assert torch.equal(region.tensor, expected)
        assert client.localize().lost == {"model": []}


PARENT = textwrap.dedent(
    """
    import subprocess, sys
    proc = subprocess.Popen([sys.executable, "-m", "unbroken.state.manager", "--socket",
                             sys.argv[1], "--log-level", "WARNING"])
    print(proc.pid, flush=True)
    sys.stdin.read()  # live until the test kills us
    """
)


def test_manager_exits_when_its_parent_dies(run_dir):
    path = run_dir / "rmp" / "rank3.sock"
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(path)],
        env=manager_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        manager_pid = int(parent.stdout.readline())
        with RetainedClient(path) as client:  # serving
            client.allocate("marker", PAGE, page_bytes=PAGE, protected=True)
            parent.kill()
            parent.wait(10)
            assert wait_pid_exit(manager_pid, timeout_s=10), "manager outlived its parent"
        assert not path.exists()
    finally:
        parent.kill()
        parent.wait()


def test_shutdown_stops_the_manager_and_removes_the_socket(manager):
    proc, path = manager
    with RetainedClient(path) as client:
        client.allocate("undo", PAGE, page_bytes=PAGE, protected=False)
        client.shutdown()
    assert proc.wait(10) == 0
    assert not path.exists()
