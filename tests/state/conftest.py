"""Fixtures for the state-manager tests: real manager processes on short socket paths."""

from __future__ import annotations

import os
import select
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from unbroken.state import RetainedClient

SRC = str(Path(__file__).resolve().parents[2] / "src")


def manager_env() -> dict[str, str]:
    """Environment in which `python -m unbroken.state.manager` imports this checkout."""
    env = dict(os.environ)
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    return env


def wait_pid_exit(pid: int, timeout_s: float) -> bool:
    """Wait (via a pidfd, no polling) until process `pid` exits; False on timeout."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        ready, _, _ = select.select([pidfd], [], [], timeout_s)
        return bool(ready)
    finally:
        os.close(pidfd)


@pytest.fixture
def run_dir() -> Iterator[Path]:
    """A short private directory (AF_UNIX paths are limited to 107 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="rmp-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def spawn_manager(run_dir: Path) -> Iterator[Callable[..., tuple[subprocess.Popen, Path]]]:
    """Start manager processes; each call returns (process, socket path) once it serves."""
    procs: list[subprocess.Popen] = []

    def spawn(
        name: str = "rank0.sock", rank: int = 0, extra: tuple[str, ...] = ()
    ) -> tuple[subprocess.Popen, Path]:
        path = run_dir / "rmp" / name
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "unbroken.state.manager",
                "--socket",
                str(path),
                "--rank",
                str(rank),
                "--log-level",
                "WARNING",
                *extra,
            ],
            env=manager_env(),
        )
        procs.append(proc)
        RetainedClient(path, timeout_s=10).close()  # waits until the socket accepts
        return proc, path

    yield spawn
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture
def manager(spawn_manager) -> tuple[subprocess.Popen, Path]:
    """One running manager: (process, socket path)."""
    return spawn_manager()


@pytest.fixture
def client(manager) -> Iterator[RetainedClient]:
    """A client connected to `manager`."""
    with RetainedClient(manager[1], timeout_s=10) as c:
        yield c
