"""`unbroken demo --nodes 2`: the demo job on two local "hosts".

Node 0 is this process (the coordinator and its agent on 127.0.0.1); node 1 is an agent started
here as a second host would start it — its own process, connecting from 127.0.0.2 with the job
secret — and running ranks 2 and 3. Near the end node 1 is lost at once (`nodeloss`: its agent
and every process under it die); the job re-plans onto node 0's ranks from their retained
state, and the table shows the node's loss and its recovery. The fault-free reference runs on
node 0 alone, as every multi-node job's does.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
from types import TracebackType

from unbroken.config import JobConfig, NodesConfig
from unbroken.launch.rendezvous import NodeJoin

__all__ = ["SecondNode", "two_nodes"]

NODE1_ADDR = "127.0.0.2"


def two_nodes(cfg: JobConfig) -> JobConfig:
    """The demo job on 2 nodes: its slow fault (on a rank of node 1) gives way to the loss of
    node 1 a few iterations before the end."""
    iterations = cfg.train.iterations
    faults = [f for f in cfg.inject if not f.startswith("slow:")]
    faults.append(f"nodeloss:rank=3,iter={iterations - 8},phase=forward")
    return dataclasses.replace(cfg, nodes=NodesConfig(count=2), inject=faults)


class SecondNode:
    """Node 1's agent, for the length of a `with` block (killed on the way out if the job did
    not shut it down)."""

    def __init__(self) -> None:
        with socket.socket() as s:  # a free port for the coordinator of the faulty run
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.secret = os.urandom(32).hex()
        self.join = NodeJoin(2, 0, "127.0.0.1", self.port, "unbroken demo --nodes 2")
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> SecondNode:
        cmd = [sys.executable, "-m", "unbroken.launch.agent", "--coordinator"]
        cmd += [f"127.0.0.1:{self.port}", "--node", "1", "--local-addr", NODE1_ADDR]
        # It waits for the faulty run's coordinator, which listens once the reference is done.
        cmd += ["--connect-timeout", "3600"]
        env = dict(os.environ, UNBROKEN_JOB_SECRET=self.secret)
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL)
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
