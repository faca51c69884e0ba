"""The shadow fork server: children start with the preloaded imports, get their log as stdout,
a pipe as stdin and the requested priority, report exit statuses like `subprocess.Popen`, and die
with the server."""

from __future__ import annotations

import os
import signal
import time

import pytest

from unbroken.shadow.forkserver import ShadowForkServer


def _read_until(path, prefix: str, proc) -> str:
    """The first log line starting with `prefix` (waits on the child, never on a clock alone)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if path.exists():
            for line in path.read_text().splitlines():
                if line.startswith(prefix):
                    return line
        if proc.poll() is not None and not path.read_text().count(prefix):
            raise AssertionError(f"child exited ({proc.poll()}) before printing {prefix!r}")
        time.sleep(0.01)  # polling a file the child writes
    raise TimeoutError(prefix)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


@pytest.fixture(scope="module")
def server():
    fs = ShadowForkServer(["torch", "tests.shadow.children"])
    assert fs.ready.wait(120), fs.failed
    return fs


def test_child_runs_preloaded_reads_its_promotion_and_reports_its_status(server, tmp_path):
    log = tmp_path / "child.log"
    proc = server.spawn(["7"], str(log), 5, entry="tests.shadow.children:echo")
    who = _read_until(log, "pid=", proc)
    fields = dict(kv.split("=") for kv in who.split())
    assert int(fields["pid"]) == proc.pid
    assert int(fields["ppid"]) != os.getpid()  # a child of the server, not of ours
    assert int(fields["nice"]) == os.nice(0) + 5
    assert _read_until(log, "torch-preloaded=", proc) == "torch-preloaded=True"
    assert proc.poll() is None  # parked on its stdin
    proc.stdin.write(b"promote gen 3\n")
    proc.stdin.flush()
    assert proc.wait(timeout=60) == 7
    assert _read_until(log, "got=", proc) == "got=promote gen 3"


def test_kill_reports_the_signal_like_popen(server, tmp_path):
    log = tmp_path / "child.log"
    proc = server.spawn(["0"], str(log), 0, entry="tests.shadow.children:echo")
    _read_until(log, "pid=", proc)
    proc.kill()
    assert proc.wait(timeout=60) == -signal.SIGKILL
    assert proc.poll() == -signal.SIGKILL


def test_children_die_with_the_server(tmp_path):
    fs = ShadowForkServer(["tests.shadow.children"])
    assert fs.ready.wait(120), fs.failed
    log = tmp_path / "child.log"
    proc = fs.spawn(["0"], str(log), 0, entry="tests.shadow.children:echo")
    who = dict(kv.split("=") for kv in _read_until(log, "pid=", proc).split())
    server_pid = int(who["ppid"])
    os.kill(server_pid, signal.SIGKILL)  # the server (and with it the agent's node) is gone
    assert proc.wait(timeout=60) == 255  # the status was the server's to report; it is lost with it
    assert not _alive(proc.pid)  # PDEATHSIG: no orphaned shadow
