"""The coordinator of one run: starts the job's services (the store, the control server, the
local node's agent), then loops — messages to the core, the logs to the monitor, node liveness
— until the recovery state machine is DONE or FAILED.

It never runs training code and never holds a process group, so a dead or hung trainer cannot
take the rendezvous or the control plane with it. Each generation of trainers joins the store
under its own prefix (`JobStore.generation_store`).

The parts: `ControlServer` (sockets, authentication, typed messages), `CoordinatorCore` (the
recovery state machine and its actions), `RunMonitor` (progress, fail-slow watch, recovery
breakdowns from the run's logs). Node identity and addresses are data (`NodeLayout`,
`Endpoints`): the embedded default is one node on 127.0.0.1 whose agent this process starts.
A multi-node job (`nodes.count` > 1) listens on its rendezvous endpoint; this process starts
node 0's agent and the other nodes' agents join (`unbroken train --node-rank R`), proving the
job secret on every frame. A node that is lost is fenced: its connection is closed, and if it
comes back its frames are refused (`node_fenced`) — its agent then stops its processes. A
*fresh* agent of a lost node (a new connection that opens with a `Hello`: the host came back,
or its command was started again) is re-admitted instead when the job re-plans
(`CoordinatorCore.readmit`): its devices join the next generation.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from unbroken.config import JobConfig
from unbroken.jobstore import JobStore
from unbroken.launch.coordinator.core import CoordinatorCore
from unbroken.launch.coordinator.load import LoadStats
from unbroken.launch.coordinator.monitor import RunMonitor, analysis_window_s, run_info
from unbroken.launch.coordinator.nodes import Endpoints, NodeLayout
from unbroken.launch.coordinator.replay import ReplayPoint
from unbroken.launch.coordinator.server import ControlServer, Dropped, Received
from unbroken.messages import Hello, Shutdown
from unbroken.metrics.log import JsonlLog
from unbroken.metrics.observer import RunObserver

__all__ = ["Coordinator", "RunOutcome"]


@dataclass(slots=True)
class RunOutcome:
    run_name: str
    state: str
    generations: int
    restarts: int
    final_state_hash: str | None
    reason: str = ""
    rank_hashes: list[str] | None = None
    """Every rank's own final state hash (the audit compares all of them)."""
    metrics: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)


class Coordinator:
    """Runs one job (one "run") to completion through failures.

    Args:
        cfg: the job config.
        run_dir: output dir (events.jsonl, metrics.jsonl, checkpoints/RUN).
        run_name: label of this run in the logs ("reference", "faulty", "train").
        search_path: dirs trainers add to sys.path (user model/dataset modules).
        quiet: no terminal progress.
        debug: failed ranks' tracebacks on the terminal.
        endpoints: where the job's services listen (default: loopback, any free ports; a
            multi-node job gives its rendezvous host and control port).
        secret: the job secret's text (`unbroken.launch.rendezvous`); default: a fresh random
            one, which only a single-node job can use (its one agent is told it).
        observers: live observers of the run (`unbroken.metrics.observer`), told by its
            monitor of every iteration, event and recovery.
        start: a replaying reference run's start (its plan and world, from the checkpoint a
            re-planned run kept: [Note: replayed plan change] in
            `unbroken.launch.coordinator.adapt_plan`); None: the config's.
    """

    def __init__(
        self,
        cfg: JobConfig,
        run_dir: str | Path,
        run_name: str = "train",
        *,
        search_path: list[str] | None = None,
        quiet: bool = False,
        debug: bool = False,
        endpoints: Endpoints | None = None,
        observers: Sequence[RunObserver] = (),
        secret: str | None = None,
        start: ReplayPoint | None = None,
    ) -> None:
        from unbroken.engine.build import job_plan
        from unbroken.launch.rendezvous import secret_key
        from unbroken.parallel import ParallelPlan

        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.run_name = run_name
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.events = JsonlLog(self.run_dir / "events.jsonl", run=run_name)
        self.start = start
        world = start.world if start is not None else cfg.parallel.world_size
        self.layout = NodeLayout.even(cfg.nodes.count, cfg.nodes.per_node(world))
        self.endpoints = endpoints or Endpoints()
        self.search_path = search_path or []
        self.debug = debug
        if secret is None and cfg.nodes.count > 1:
            raise ValueError("a multi-node job needs the job secret its nodes share")
        self.secret_text = secret or os.urandom(32).hex()
        self.secret = secret_key(self.secret_text)
        plan = job_plan(cfg, self.search_path)
        if start is not None:
            plan = ParallelPlan.from_dict(start.plan)
        self.monitor = RunMonitor(
            self.run_dir,
            run_name,
            world,
            cfg.train.iterations,
            self.events,
            plan=plan,
            quiet=quiet,
            info=run_info(cfg, run_name, plan, world),
            observers=observers,
            window_s=analysis_window_s(
                cfg.recovery.heartbeat_timeout_s, cfg.recovery.node_timeout_s
            ),
        )
        self.agent_proc: subprocess.Popen | None = None
        self.agent_silent = False
        """Its agent's beats stopped: it is hung (or stopped), and will not exit on its own."""

    # -- services -------------------------------------------------------------------------
    def _start_services(self) -> CoordinatorCore:
        host = self.endpoints.host
        store = JobStore.host(host, self.cfg.recovery.collective_timeout_s)
        self.server = ControlServer(host, self.secret, self.endpoints.control_port)
        self.endpoints = Endpoints(host=host, store_port=store.port, control_port=self.server.port)
        # Written whole, then renamed: a reader polling for the file (`unbroken control`, the
        # tests) never sees it empty (one CI run read it between the create and the write).
        info = self.run_dir / f"coordinator-{self.run_name}.json"
        tmp = info.with_suffix(".json.tmp")
        tmp.write_text(f'{{"host": "{host}", "port": {self.server.port}, "pid": {os.getpid()}}}\n')
        os.replace(tmp, info)
        core = CoordinatorCore(
            self.cfg,
            self.run_dir,
            self.run_name,
            layout=self.layout,
            endpoints=self.endpoints,
            send=self.server.send,
            events=self.events,
            monitor=self.monitor,
            store=store,
            search_path=self.search_path,
            debug=self.debug,
            start=self.start,
        )
        self.store = store
        self.load = LoadStats(self.events, store.raw.num_keys, core.faults_fired)
        self.monitor.slow_watch.detector.sink = core
        self.monitor.slow_watch.on_recovered = core.on_speed_recovered
        env = dict(os.environ, UNBROKEN_JOB_SECRET=self.secret_text)
        self.agent_proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "unbroken.launch.agent",
                "--coordinator",
                f"{host}:{self.server.port}",
                "--node",
                str(self.layout.node_ids[0]),
            ],
            env=env,
            stdin=subprocess.DEVNULL,
        )
        return core

    # -- main loop ------------------------------------------------------------------------
    def run(self) -> RunOutcome:
        core = self.core = self._start_services()
        self.events.emit("job_start", world_size=self.layout.world_size, port=self.server.port)
        self.monitor.say(
            f"starting {self.layout.world_size} ranks "
            f"(recovery: {self.cfg.recovery.mode}, faults: {len(self.cfg.inject)})"
        )
        t_hello = time.time()
        self.monitor.start()
        try:
            while not core.fsm.over:
                items = self.server.poll(timeout=0.05)
                # The run's logs before the nodes' messages of the same turn: what the ranks
                # wrote was written before any failure those messages report (progress, then
                # the failure), so observers and the live page see them in that order — on a
                # fast machine a failure's report and several iterations' rows arrive in one turn.
                t = time.perf_counter()
                self.monitor.poll()
                self.load.polled(time.perf_counter() - t)
                for item in items:
                    t = time.perf_counter()
                    self._dispatch(core, item)
                    self.load.handled(time.perf_counter() - t)
                # Liveness right after reading what the nodes sent: a node is judged on the
                # beats that arrived, even if this loop was busy elsewhere since its last turn.
                self._check_nodes(core, t_hello)
                core.tick(time.time())
                self.load.tick()
            self.monitor.poll()
            self.load.tick(final=True)
        finally:
            self._shutdown()
        self.monitor.finish(core.fsm.state.value, core.done_reason)
        self.events.emit(
            "job_end",
            state=core.fsm.state.value,
            reason=core.done_reason,
            detector_s=self.monitor.slow_watch.overhead_s,
        )
        events = self.monitor.seen_events
        done = next((e for e in reversed(events) if e["kind"] == "trainer_done"), {})
        return RunOutcome(
            run_name=self.run_name,
            state=core.fsm.state.value,
            generations=core.fsm.generation + 1,
            restarts=core.fsm.restarts,
            final_state_hash=done.get("final_state_hash"),
            reason=core.done_reason,
            rank_hashes=done.get("rank_hashes"),
            metrics=self.monitor.rows,
            events=events,
        )

    def _dispatch(self, core: CoordinatorCore, item: Received | Dropped) -> None:
        if item.node is not None and item.node in core.gone:
            msg = item.message if isinstance(item, Received) else None
            if not (isinstance(msg, Hello) and core.readmit(item.node, msg)):
                self._fence(item.node, item, core.fsm.generation)
            return
        if isinstance(item, Dropped):
            self.events.emit("control_rejected", peer=item.peer, reason=item.reason)
            if not (item.closed and item.node is not None):  # a node's end is said below
                self.monitor.say(f"control channel: rejected {item.peer}: {item.reason}")
            if item.node is not None:
                self._lose(core, item.node, item.reason)
            return
        assert item.node is not None
        try:
            core.handle(item.node, item.message)
        except ValueError as exc:  # a message that contradicts the job (an unknown node)
            self.events.emit("control_rejected", peer=f"node {item.node}", reason=str(exc))

    def _lose(self, core: CoordinatorCore, node: int, reason: str, silent: float | None = None):
        """`node` is lost: the core decides what follows; its connection, if still open, is
        closed, so that its agent — should it run again — finds itself cut off and stops."""
        core.node_lost(node, reason, silent)
        self.server.disconnect(node)

    def _fence(self, node: int, item: Received | Dropped, generation: int) -> None:
        """A frame from (or the end of) a node already lost: refused, its connection closed."""
        if isinstance(item, Dropped):
            return
        what = item.message.OP
        why = f"node {node} was declared lost earlier in this job; it may not rejoin it"
        ran = getattr(item.message, "generation", -1)
        if isinstance(item.message, Hello) and ran >= 0:
            why += f" (this agent ran generation {ran}: only a fresh agent may)"
        with contextlib.suppress(OSError):
            self.server.send(node, Shutdown(fenced=why, generation=generation))
        self.server.disconnect(node)
        self.events.emit("node_fenced", node=node, message=what)
        self.monitor.say(f"node {node}: lost earlier, refused its {what!r} and disconnected it")

    def _check_nodes(self, core: CoordinatorCore, t_hello: float) -> None:
        now = time.time()
        if core.fsm.over:
            return
        missing = set(core.live_nodes) - set(core.joined)
        if missing and now - t_hello > self.cfg.nodes.join_timeout_s:
            core.give_up(
                f"node(s) {sorted(missing)} did not join within nodes.join_timeout_s = "
                f"{self.cfg.nodes.join_timeout_s:g} s (started with --node-rank, the same "
                f"--rdzv-endpoint {self.endpoints.host}:{self.server.port} and job secret?)"
            )
            return
        for node, seen in list(core.joined.items()):
            silent = now - seen
            if node in self.server.nodes and silent > self.cfg.recovery.node_timeout_s:
                self.agent_silent = self.agent_silent or node == self.layout.node_ids[0]
                self._lose(core, node, f"beats stopped (agent silent for {silent:.1f}s)", silent)
                return
        local = self.layout.node_ids[0]
        proc = self.agent_proc
        if proc is not None and local not in core.gone and proc.poll() is not None:
            self._lose(core, local, f"agent exited with status {proc.returncode}")

    def _shutdown(self) -> None:
        if self.agent_proc is not None:
            # A healthy agent stops its processes and exits after Shutdown; a silent one never
            # will, so it is killed at once instead of after the grace period.
            grace = 0.0 if self.agent_silent else 30.0
            try:
                self.agent_proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self.agent_proc.kill()
                self.agent_proc.wait()
        self.server.close()
