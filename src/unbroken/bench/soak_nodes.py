"""The soak's other nodes: agents started as second hosts would start them, and the last node
brought back after it is lost, as an operator would.

A multi-node soak (`unbroken bench soak --nodes N`, N > 1) runs node 0 in the bench process
(`run_job`: the coordinator and node 0's agent) and every other node as its own agent process
connecting from its own loopback address (127.0.0.2, ...) with the job secret, as
`unbroken demo --nodes 2` does. Its schedule loses devices and whole nodes, always of the last
node (`unbroken.bench.soak_schedule`). `NodeKeeper` watches that node's agent: when the agent
dies by SIGKILL (the `nodeloss` fault kills it, and every process of its node dies with it),
the keeper clears the node's records in the job's device registry (its hardware was
replaced) and starts the agent again after `reboot_s`: a fresh agent whose `Hello` the
coordinator re-admits, so the job grows back to its launch world. An agent that exits any
other way (the job's end, a fence) is not started again.

Why not `subprocess` supervision from a library: the restart rule (only after SIGKILL, only
while the job runs, the registry cleared first) is the soak's model of an operator, not a
generic restart policy.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from unbroken.devices import DeviceRegistry
from unbroken.launch.rendezvous import NodeJoin

__all__ = ["NodeKeeper", "Restart", "node_address"]


def node_address(node: int) -> str:
    """The loopback address node `node` connects from (node 0: 127.0.0.1)."""
    return f"127.0.0.{node + 1}"


@dataclass(frozen=True, slots=True)
class Restart:
    """One return of the kept node: its agent died (`returncode`) at `t_exit` (wall clock),
    its registry records of `cleared` devices were removed, and a fresh agent started at
    `t_start`."""

    t_exit: float
    returncode: int
    cleared: tuple[int, ...]
    t_start: float


@dataclass
class NodeKeeper:
    """The agents of nodes 1..nnodes-1 for the length of a `with` block; the last node is
    started again after each SIGKILL (module docstring).

    Args:
        nnodes: the job's nodes.
        ranks_per_node: ranks (and devices) per node; node n holds devices
            n*ranks_per_node ... (n+1)*ranks_per_node - 1.
        registry: the faulty run's device registry (`RUN_DIR/devices/faulty`).
        connect_timeout_s: how long an agent waits for the coordinator (the first start
            waits through the fault-free reference).
        reboot_s: seconds between the node's death and its fresh agent.
    """

    nnodes: int
    ranks_per_node: int
    registry: Path
    connect_timeout_s: float = 3600.0
    reboot_s: float = 1.0
    restarts: list[Restart] = field(default_factory=list)
    port: int = 0
    secret: str = field(default_factory=lambda: os.urandom(32).hex())
    _procs: dict[int, subprocess.Popen] = field(default_factory=dict)
    _stopping: threading.Event = field(default_factory=threading.Event)
    _changed: threading.Condition = field(default_factory=threading.Condition)
    _watch: threading.Thread | None = None
    _done: bool = False

    def __post_init__(self) -> None:
        if self.nnodes < 2:
            raise ValueError("NodeKeeper: a job of one node has no other node to keep")
        if not self.port:
            with socket.socket() as s:  # a free port for the faulty run's coordinator
                s.bind(("127.0.0.1", 0))
                self.port = s.getsockname()[1]

    @property
    def join(self) -> NodeJoin:
        """Node 0's place in the job (for `run_job(join=...)`)."""
        return NodeJoin(self.nnodes, 0, "127.0.0.1", self.port, "unbroken bench soak")

    @property
    def kept(self) -> int:
        """The node that is lost and brought back: the last."""
        return self.nnodes - 1

    def _start(self, node: int, timeout_s: float) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "unbroken.launch.agent", "--coordinator"]
        cmd += [f"127.0.0.1:{self.port}", "--node", str(node)]
        cmd += ["--local-addr", node_address(node), "--connect-timeout", f"{timeout_s:g}"]
        env = dict(os.environ, UNBROKEN_JOB_SECRET=self.secret)
        proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL)
        self._procs[node] = proc
        return proc

    def __enter__(self) -> NodeKeeper:
        for node in range(1, self.nnodes):
            self._start(node, self.connect_timeout_s)
        self._watch = threading.Thread(target=self._keep, name="soak-node-keeper", daemon=True)
        self._watch.start()
        return self

    def _keep(self) -> None:
        """Wait on the kept node's agent; bring the node back after each SIGKILL."""
        try:
            while not self._stopping.is_set():
                code = self._procs[self.kept].wait()
                if self._stopping.is_set() or code != -signal.SIGKILL:
                    return
                t_exit = time.time()
                cleared = self._replace_hardware()
                if self._stopping.wait(self.reboot_s):
                    return
                self._start(self.kept, 120.0)
                with self._changed:
                    self.restarts.append(Restart(t_exit, code, cleared, time.time()))
                    self._changed.notify_all()
        finally:
            with self._changed:
                self._done = True  # waiters need not wait longer
                self._changed.notify_all()

    def agent(self, node: int) -> subprocess.Popen:
        """Node `node`'s agent process (the newest one)."""
        return self._procs[node]

    @property
    def keeping(self) -> bool:
        """Whether the kept node is still brought back when it dies."""
        return self._watch is not None and not self._done

    def wait_restarts(self, n: int, timeout_s: float) -> bool:
        """Wait until the kept node was started again `n` times; False if the keeper stopped
        or `timeout_s` passed first."""
        with self._changed:
            self._changed.wait_for(lambda: len(self.restarts) >= n or not self.keeping, timeout_s)
            return len(self.restarts) >= n

    def _replace_hardware(self) -> tuple[int, ...]:
        """Clear the kept node's devices from the registry: they are healthy again."""
        registry = DeviceRegistry(self.registry)
        first = self.kept * self.ranks_per_node
        devices = range(first, first + self.ranks_per_node)
        cleared = tuple(d for d in devices if registry.lost(d) is not None)
        for d in cleared:
            registry.clear(d)
        return cleared

    def stop(self, timeout_s: float = 30.0) -> None:
        """No more restarts; wait up to `timeout_s` for the agents to end (the job's end
        shuts them down), then kill what is left."""
        self._stopping.set()
        deadline = time.monotonic() + timeout_s
        self._end(list(self._procs.values()), deadline)
        if self._watch is not None:
            self._watch.join()  # it returns once its agent ended; it starts no other now
        self._end(list(self._procs.values()), deadline)

    @staticmethod
    def _end(procs: list[subprocess.Popen], deadline: float) -> None:
        for proc in procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def __exit__(self, *exc: object) -> None:
        self.stop()
