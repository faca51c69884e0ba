"""Shadow processes forked from a pre-imported server: level L1 in milliseconds.

A shadow's first level (Leto §6) is "interpreter started, every import done". Reaching it from
an `exec` costs seconds of CPU per process (measured on the 2-core CI machine: 16-22 s until a
niced L3 shadow was ready behind four busy trainers, most of it importing torch), and on a busy
node that start-up competes with training. The agent instead keeps one fork server per node,
preloaded with the trainer's imports (`TRAINER_IMPORTS`), and forks every shadow from it:
each starts at L1 at once, sharing the imported pages copy-on-write, and spends its own start-up
on L2/L3 only.

The server is the standard library's `multiprocessing` fork server (preload, fork on request,
exit statuses through a per-child sentinel pipe); this module only adds what a trainer process
needs around it: its log as stdout/stderr, a pipe as stdin for the promotion message, a lower
CPU priority, death with its parent, and a `subprocess.Popen`-like handle for the agent.

`Process.start()` blocks until the server has forked; while the server is still importing that
is seconds, so the agent must not call `spawn` before `ready` is set — a warm-up thread starts
the server and forks one no-op child to find out. If the server cannot start, `failed` says why
and the agent starts shadows with `exec` as before.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import multiprocessing
import os
import select
import signal
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection

__all__ = ["ForkedProc", "ShadowForkServer"]

PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True)  # loaded once here, never inside a forked child


class ForkedProc:
    """The `subprocess.Popen` subset the agent uses, for a child of the fork server."""

    def __init__(self, process: multiprocessing.process.BaseProcess, stdin_fd: int) -> None:
        self._process = process
        self.pid: int = process.pid  # type: ignore[assignment]
        self.stdin = os.fdopen(stdin_fd, "wb")
        # The status comes through the server; whether the process is really gone (its memory
        # returned) comes from the kernel: a pidfd turns readable when the process has exited.
        # If the server dies, statuses read 255 and its children die with it (PDEATHSIG).
        self._pidfd: int | None = os.pidfd_open(self.pid)

    def _gone(self, timeout: float | None) -> bool:
        if self._pidfd is None:
            return True
        if not select.select([self._pidfd], [], [], timeout)[0]:
            return False
        os.close(self._pidfd)
        self._pidfd = None
        return True

    def poll(self) -> int | None:
        """Exit status once the process has exited (negative: killed by that signal). The
        kernel's word (the pidfd) decides; the status then follows from the server within
        moments, and is waited for — a dead shadow must never look alive."""
        if not self._gone(0):
            return None
        self._process.join()
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        if self._process.exitcode is None:
            with contextlib.suppress(ProcessLookupError):  # exited since the check
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        """Block until the process is gone (not only reported by the server); like
        `Popen.wait`, raise `subprocess.TimeoutExpired` after `timeout` seconds."""
        t0 = time.monotonic()
        self._process.join(timeout)
        left = None if timeout is None else max(0.0, timeout - (time.monotonic() - t0))
        if self._process.exitcode is None or not self._gone(left):
            raise subprocess.TimeoutExpired(f"shadow pid {self.pid}", timeout or 0.0)
        self.stdin.close()
        return self._process.exitcode


def _noop() -> None:
    """The warm-up child: proves the server has finished importing and can fork."""


def _shadow_main(
    entry: str,
    argv: list[str],
    promote: Connection,
    log_path: str | None,
    nice: int,
    cgroup_procs: str | None,
) -> None:
    """Runs in the forked child: set the process up as `exec` would have, then call `entry`
    ("module:function") with `argv`."""
    server = os.getppid()
    _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if server == 1 or os.getppid() != server:  # orphaned before the line above took effect
        os._exit(1)
    if cgroup_procs:  # under the job's memory budget before it allocates anything
        with open(cgroup_procs, "w") as fh:
            fh.write(str(os.getpid()))
    if nice:
        os.nice(nice)
    os.dup2(promote.fileno(), 0)
    promote.close()
    sys.stdin = open(0, encoding="utf-8", closefd=False)  # noqa: SIM115 - the process's stdin
    if log_path:
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    module, _, function = entry.partition(":")
    code = getattr(importlib.import_module(module), function)(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)  # the trainer's main exits itself; anything else exits here


class ShadowForkServer:
    """One per agent: starts the server in the background; `spawn` once `ready` is set."""

    def __init__(self, preload: list[str]) -> None:
        self._ctx = multiprocessing.get_context("forkserver")
        self._ctx.set_forkserver_preload(preload)
        self.ready = threading.Event()
        self.failed: str | None = None
        self.warmup_s: float | None = None
        threading.Thread(target=self._warm_up, name="forkserver-warmup", daemon=True).start()

    def _warm_up(self) -> None:
        t0 = time.monotonic()
        try:
            p = self._ctx.Process(target=_noop, name="unbroken-forkserver-warmup")
            p.start()
            p.join()
            if p.exitcode != 0:
                raise RuntimeError(f"the warm-up child exited with status {p.exitcode}")
        except Exception as exc:  # report and fall back to exec; never take the agent down
            self.failed = f"{type(exc).__name__}: {exc}"
        else:
            self.warmup_s = time.monotonic() - t0
            self.ready.set()

    def spawn(
        self,
        argv: list[str],
        log_path: str | None,
        nice: int,
        entry: str = "unbroken.launch.trainer:main",
        cgroup_procs: str | None = None,
    ) -> ForkedProc:
        """Fork a process that runs `entry(argv)` (by default a trainer, `argv` being its
        `unbroken.launch.trainer` arguments), stdout/stderr appended to `log_path`, stdin a
        pipe (`ForkedProc.stdin`), at niceness `nice`, in the memory cgroup whose `cgroup.procs`
        file is `cgroup_procs` (None: the server's). Call once `ready` is set: before that,
        this blocks until the server has finished importing."""
        r, w = os.pipe()
        promote = Connection(r, writable=False)
        p = self._ctx.Process(
            target=_shadow_main,
            args=(entry, argv, promote, log_path, nice, cgroup_procs),
            name="unbroken-shadow",
            daemon=True,  # if the agent exits without killing it, multiprocessing does
        )
        try:
            p.start()
        finally:
            promote.close()
        return ForkedProc(p, w)
