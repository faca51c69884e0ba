"""The agent's process supervisor: spawns a node's trainers, shadows and state managers, kills
and reaps them. It decides nothing about when; the event loop and the shadow pool do.

Every trainer and shadow dies with the agent (PR_SET_PDEATHSIG, set between fork and exec),
joins the job's memory cgroup before it allocates anything (once the node has a memory budget:
`cgroup_procs`), and writes stdout/stderr to its log under the job's log directory. Shadows run
at a lower CPU priority (`SHADOW_NICE`) so their pre-initialization does not slow the trainers
they stand behind, take their promotion on a stdin pipe, and are forked from the node's fork
server (`unbroken.shadow.forkserver`) once it is ready, with `exec` otherwise.

The trainer command is a parameter (`trainer_cmd`, `trainer_entry` for the fork server) so the
agent can be exercised with a harmless stand-in.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Protocol

from unbroken.launch.agent.hang import Liveness
from unbroken.launch.agent.procs import RankProc
from unbroken.messages import StartGeneration

if TYPE_CHECKING:
    from unbroken.shadow.forkserver import ShadowForkServer

__all__ = ["SHADOW_NICE", "TRAINER_CMD", "TRAINER_ENTRY", "ProcessSupervisor", "shadow_nice"]

PR_SET_PDEATHSIG = 1
SHADOW_NICE = 10


def shadow_nice(job_nice: int | None = None) -> int:
    """How much nicer than the job its shadows run: `SHADOW_NICE` where the agent may give a
    promoted shadow the job's priority back (root, or an RLIMIT_NICE that allows it), else 0.
    An unprivileged agent cannot lower a niceness it raised: a shadow promoted at +10 would be a
    trainer left behind by its peers at every collective for the rest of the run."""
    import resource

    job = os.getpriority(os.PRIO_PROCESS, 0) if job_nice is None else job_nice
    if os.geteuid() == 0:
        return SHADOW_NICE
    soft, _ = resource.getrlimit(resource.RLIMIT_NICE)
    floor = 20 - soft if soft != resource.RLIM_INFINITY else -20  # the lowest niceness allowed
    return SHADOW_NICE if floor <= job else 0


TRAINER_CMD: tuple[str, ...] = (sys.executable, "-m", "unbroken.launch.trainer")
TRAINER_ENTRY = "unbroken.launch.trainer:main"
"""What a forked shadow runs, with the arguments that follow `TRAINER_CMD`."""

_LIBC = ctypes.CDLL(None, use_errno=True)  # loaded here: no dlopen between fork and exec


class _Killable(Protocol):
    def poll(self) -> int | None: ...
    def kill(self) -> None: ...
    def wait(self, timeout: float | None = None) -> int: ...


def _die_with_parent() -> None:
    """In a child before exec: SIGKILL it when the agent dies, so no trainer outlives its
    supervisor (children are spawned from the agent's main thread, so "parent" is the agent;
    the fork server's warm-up thread spawns nothing but the server)."""
    _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


class ProcessSupervisor:
    """Spawns, kills and reaps the processes of one node.

    Args:
        heartbeat_addr: the agent's heartbeat socket ("@..." abstract address).
        reclaim_addr: the agent's reclamation socket.
        trainer_cmd: the command line of a trainer, before its arguments.
        trainer_entry: "module:function" a forked shadow calls with those arguments.
    """

    def __init__(
        self,
        heartbeat_addr: str,
        reclaim_addr: str,
        trainer_cmd: tuple[str, ...] = TRAINER_CMD,
        trainer_entry: str = TRAINER_ENTRY,
    ) -> None:
        self.heartbeat_addr = heartbeat_addr
        self.reclaim_addr = reclaim_addr
        self.trainer_cmd = trainer_cmd
        self.trainer_entry = trainer_entry
        self.cgroup_procs: str | None = None
        """`cgroup.procs` of the job's memory cgroup, once the node has a memory budget."""
        self.forkserver: ShadowForkServer | None = None
        """The node's pre-imported fork server for shadows, started with the first generation
        whose shadows start with "fork" (recovery.shadow_start)."""
        self.state_managers: dict[int, subprocess.Popen] = {}
        self.shadow_nice = shadow_nice()
        """Niceness of shadows above the job's (`shadow_nice`)."""

    # -- the fork server --------------------------------------------------------------------
    def start_forkserver(self) -> None:
        """Start the fork server in the background (once); `forkserver_ready` says when."""
        if self.forkserver is not None:
            return
        from unbroken.launch.trainer import TRAINER_IMPORTS
        from unbroken.shadow.forkserver import ShadowForkServer

        self.forkserver = ShadowForkServer(TRAINER_IMPORTS)

    def forkserver_ready(self) -> bool:
        return self.forkserver is not None and self.forkserver.ready.is_set()

    def forkserver_starting(self) -> bool:
        """Started, still importing, not failed: shadows wait for it."""
        fs = self.forkserver
        return fs is not None and not fs.ready.is_set() and fs.failed is None

    def fork_failed(self) -> str | None:
        """Why the fork server could not start (None: it did, or was never asked to)."""
        fs = self.forkserver
        return fs.failed if fs is not None and fs.failed else None

    # -- spawning ---------------------------------------------------------------------------
    def spawn(
        self,
        msg: StartGeneration,
        rank: int,
        generation: int,
        spec: str,
        shadow_level: int = 0,
        attempt: int = 0,
        *,
        fork: bool = False,
    ) -> RankProc:
        """Start `rank`'s trainer of `generation` from `spec` (a shadow at `shadow_level` > 0,
        for its `attempt`-th set of shadows), its log in `msg.log_dir`. Shadows, and a trainer
        with `fork`, start from the node's fork server when it is ready (every import done);
        other trainers are new interpreters (a restart without shadows pays its imports)."""
        args = ["--spec", spec, "--rank", str(rank)]
        args += ["--heartbeat", self.heartbeat_addr, "--reclaim", self.reclaim_addr]
        if rank in msg.ranks:  # one GPU per local device on a multi-GPU node
            devices = sorted(msg.devices.get(str(r), r) for r in msg.ranks)
            args += ["--local-rank", str(devices.index(msg.devices.get(str(rank), rank)))]
        if shadow_level:
            args += ["--shadow", str(shadow_level), "--attempt", str(attempt)]
        # Shadows pre-initialize in the background: at a lower CPU priority they do not slow
        # the active trainers they stand behind (the agent restores the job's priority when it
        # promotes one; where it could not, they run at the job's priority: `shadow_nice`).
        nice = self.shadow_nice if shadow_level else 0
        log_path = None
        if msg.log_dir:
            os.makedirs(msg.log_dir, exist_ok=True)
            kind = "shadow" if shadow_level else "gen"
            log_path = os.path.join(msg.log_dir, f"{kind}{generation}-rank{rank}.log")
        if (shadow_level or fork) and self.forkserver_ready():
            assert self.forkserver is not None
            proc = self.forkserver.spawn(
                args, log_path, nice, entry=self.trainer_entry, cgroup_procs=self.cgroup_procs
            )
        else:
            stdin = subprocess.PIPE if shadow_level else subprocess.DEVNULL
            proc = self._popen([*self.trainer_cmd, *args], log_path, stdin, self._preexec(nice))
        return RankProc(rank, generation, proc, Liveness(spawned=time.time()), log=log_path)

    def ensure_state_managers(self, sockets: dict[str, str]) -> None:
        """One state manager per device, started once and kept across trainer generations
        (they own the retained memory); they exit with the agent."""
        for device_s, path in sockets.items():
            device = int(device_s)
            proc = self.state_managers.get(device)
            if proc is None or proc.poll() is not None:
                cmd = [sys.executable, "-m", "unbroken.state.manager", "--socket", path]
                cmd += ["--rank", str(device)]
                preexec = self._preexec(0) if self.cgroup_procs else None
                # Its log, not the terminal: the terminal is for progress.
                self.state_managers[device] = self._popen(
                    cmd, f"{path}.log", subprocess.DEVNULL, preexec
                )

    @staticmethod
    def _popen(
        cmd: list[str], log_path: str | None, stdin: int, preexec: Callable[[], None] | None
    ) -> subprocess.Popen:
        if log_path is None:
            return subprocess.Popen(cmd, stdin=stdin, preexec_fn=preexec)
        with open(log_path, "ab") as log:
            return subprocess.Popen(cmd, stdin=stdin, stdout=log, stderr=log, preexec_fn=preexec)

    def _preexec(self, nice: int) -> Callable[[], None]:
        """What a child runs between fork and exec: die with the agent, join the job's memory
        budget (before it allocates anything), lower its priority."""
        procs = self.cgroup_procs

        def preexec() -> None:
            _die_with_parent()
            if procs:
                fd = os.open(procs, os.O_WRONLY)
                os.write(fd, str(os.getpid()).encode())
                os.close(fd)
            if nice:
                os.nice(nice)

        return preexec

    # -- killing and reaping ------------------------------------------------------------------
    @staticmethod
    def kill(procs: Iterable[_Killable]) -> None:
        """SIGKILL every process still running (stopped ones too), all at once, then wait until
        each is gone: their memory returns together."""
        procs = list(procs)
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        for proc in procs:
            proc.wait()

    def stop_state_manager(self, device: int) -> None:
        """Kill the state manager of a lost device (if it still runs)."""
        proc = self.state_managers.pop(device, None)
        if proc is not None:
            self.kill([proc])

    def kill_state_managers(self) -> None:
        self.kill(self.state_managers.values())
        self.state_managers.clear()
