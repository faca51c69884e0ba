"""The coordinator of one run: holds the TCPStore and the event log, accepts authenticated
agents, and drives the recovery state machine (`unbroken.recovery`).

It never runs training code and never holds a process group, so a dead or hung trainer cannot
take the rendezvous or the control plane with it. Each generation of trainers joins the store
under its own `PrefixStore("gen{N}")`.

The coordinator is the `DetectionSink` (`emit`) of every failure decision: the agent's rank
exits and hangs and its own node-loss decisions become `DetectionEvent(kind=FAIL_STOP)`, the
fail-slow watch's reports arrive as `FAIL_SLOW`; each is written to the event log (fail-stop
records here, fail-slow records by the watch) and handed to `RecoveryMachine.on_detection`.
"""

from __future__ import annotations

import os
import selectors
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from unbroken.config import JobConfig, to_dict
from unbroken.detect.events import DetectionEvent, DetectionKind, FailStopCause
from unbroken.launch.progress import Progress
from unbroken.launch.protocol import AGENT_OPS, Channel, ProtocolError
from unbroken.launch.slowwatch import SlowWatch
from unbroken.launch.trainer import GenerationSpec
from unbroken.metrics.analysis import analyze_run
from unbroken.metrics.log import JsonlLog, JsonlTail, read_jsonl
from unbroken.recovery import Action, RecoveryMachine, RecoveryState

__all__ = ["Coordinator", "RunOutcome"]

HELLO_TIMEOUT_S = 60.0


MEMORY_EVENTS = frozenset(
    {"memory_budget", "shadows_reclaimed", "shadow_level", "oom", "memory_report"}
)
"""What an agent's `memory` message may log (see unbroken.shadow.memory and .policy)."""


@dataclass(slots=True)
class RunOutcome:
    run_name: str
    state: str
    generations: int
    restarts: int
    final_state_hash: str | None
    reason: str = ""
    metrics: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)


class _Conn:
    def __init__(self, sock: socket.socket, peer: Any, secret: bytes) -> None:
        self.channel = Channel(sock, secret, AGENT_OPS)
        self.peer = peer
        self.is_agent = False


class Coordinator:
    """Runs one job (one "run") to completion through failures.

    Args:
        cfg: the job config.
        run_dir: output dir (events.jsonl, metrics.jsonl, checkpoints/RUN).
        run_name: label of this run in the logs ("reference", "faulty", "train").
        search_path: dirs trainers add to sys.path (user model/dataset modules).
        quiet: no terminal progress.
    """

    def __init__(
        self,
        cfg: JobConfig,
        run_dir: str | Path,
        run_name: str = "train",
        *,
        search_path: list[str] | None = None,
        quiet: bool = False,
    ) -> None:
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.run_name = run_name
        self.search_path = search_path or []
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.events = JsonlLog(self.run_dir / "events.jsonl", run=run_name)
        self.progress = Progress(run_name, cfg.train.iterations, quiet=quiet)
        self.secret = os.urandom(32)
        self.fsm = RecoveryMachine(
            world_size=cfg.parallel.world_size,
            max_restarts=cfg.recovery.max_restarts,
            mode=cfg.recovery.mode,
        )
        self.sel = selectors.DefaultSelector()
        self.agent: _Conn | None = None
        self.agent_proc: subprocess.Popen | None = None
        self.final_hash: str | None = None
        self._rows: list[dict[str, Any]] = []
        self._metrics_tail = JsonlTail(self.run_dir / "metrics.jsonl")
        self._timings_tail = JsonlTail(self.run_dir / "timings.jsonl")
        plan = None
        if cfg.parallel.planned:
            from unbroken.engine.build import plan_from_config

            plan = plan_from_config(cfg)
        self.slow_watch = SlowWatch(
            cfg.parallel.world_size, self.events, self.progress.say, plan=plan
        )
        self.slow_watch.detector.sink = self
        self._pending_recoveries: list[dict[str, Any]] = []
        self._done_reason = ""
        self._metrics_at_start = 0

    # -- setup --------------------------------------------------------------------------
    def _start_services(self) -> None:
        self.store = dist.TCPStore(
            "127.0.0.1",
            0,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=self.cfg.recovery.collective_timeout_s),
        )
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.setblocking(False)
        self.port = self.listener.getsockname()[1]
        self.sel.register(self.listener, selectors.EVENT_READ, None)
        (self.run_dir / f"coordinator-{self.run_name}.json").write_text(
            f'{{"host": "127.0.0.1", "port": {self.port}, "pid": {os.getpid()}}}\n'
        )
        env = dict(os.environ, UNBROKEN_JOB_SECRET=self.secret.hex())
        self.agent_proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "unbroken.launch.agent",
                "--coordinator",
                f"127.0.0.1:{self.port}",
                "--node",
                "0",
            ],
            env=env,
            stdin=subprocess.DEVNULL,
        )

    def _state_sockets(self) -> dict[str, str]:
        if self.cfg.recovery.mode != "inplace":
            return {}
        root = self.run_dir / "rmp"
        root.mkdir(exist_ok=True)
        return {
            str(r): str(root / f"{self.run_name}-rank{r}.sock")
            for r in range(self.cfg.parallel.world_size)
        }

    def _write_spec(self, generation: int, resume: bool, recovery: str) -> Path:
        spec = GenerationSpec(
            config=to_dict(self.cfg),
            run_dir=str(self.run_dir),
            run_name=self.run_name,
            store_host="127.0.0.1",
            store_port=self.store.port,
            generation=generation,
            world_size=self.cfg.parallel.world_size,
            resume=resume,
            search_path=self.search_path,
            recovery=recovery,
            state_sockets=self._state_sockets(),
        )
        path = self.run_dir / "specs" / f"{self.run_name}-gen{generation}.json"
        path.parent.mkdir(exist_ok=True)
        path.write_text(spec.to_json())
        return path

    # -- actions ------------------------------------------------------------------------
    def _execute(self, action: Action | None) -> None:
        if action is None:
            return
        assert self.agent is not None
        if action.op == "start":
            spec = self._write_spec(action.generation, action.resume, action.recovery)
            self._metrics_at_start = len(self._rows)
            if action.resume:
                self.events.emit(
                    "recovery_start", mode=action.recovery, generation=action.generation
                )
            shadow_level = self.cfg.recovery.shadow_level if self._state_sockets() else 0
            next_spec = None
            if shadow_level:
                next_spec = str(self._write_spec(action.generation + 1, True, "inplace"))
            self.agent.channel.send(
                "start",
                generation=action.generation,
                spec=str(spec),
                shadow_level=shadow_level,
                shadow_start=self.cfg.recovery.shadow_start,
                memory_budget_mb=self.cfg.recovery.memory_budget_mb,
                memory_reclaim=self.cfg.recovery.memory_reclaim,
                next_spec=next_spec,
                ranks=list(range(self.cfg.parallel.world_size)),
                heartbeat_timeout_s=self.cfg.recovery.heartbeat_timeout_s,
                node_heartbeat_s=self.cfg.recovery.node_heartbeat_s,
                state_managers=self._state_sockets(),
                log_dir=str(self.run_dir / "logs" / self.run_name),
            )
        elif action.op == "stop":
            self.agent.channel.send("stop", generation=action.generation)
        elif action.op in ("finish", "fail"):
            self._done_reason = action.reason
            self.agent.channel.send("shutdown")
        self._log_transition()

    def _log_transition(self) -> None:
        while self.fsm.transitions:
            old, new, reason = self.fsm.transitions.pop(0)
            self.events.emit("state", old=old, new=new, reason=reason, **self.fsm.snapshot())

    # -- inputs -------------------------------------------------------------------------
    def _run_events(self) -> list[dict[str, Any]]:
        """This run's events so far (the log is shared with other runs of the same dir)."""
        return [
            e for e in read_jsonl(self.run_dir / "events.jsonl") if e.get("run") == self.run_name
        ]

    def _last_injection(self, rank: int) -> dict[str, Any] | None:
        evs = [
            e
            for e in self._run_events()
            if e["kind"] == "failure_injected"
            and e["rank"] == rank
            and e["t"] > self._last_failure_t
        ]
        return evs[-1] if evs else None

    def emit(self, event: DetectionEvent) -> None:
        """`DetectionSink`: log a detected failure, then let the recovery machine act on it."""
        if event.kind is DetectionKind.FAIL_STOP:
            self._log_fail_stop(event)
        action = self.fsm.on_detection(event)
        if event.cause == FailStopCause.NODE_LOST:
            self._done_reason = event.reason  # the agent is gone: nothing to tell it
            self._log_transition()
        else:
            self._execute(action)

    def _log_fail_stop(self, event: DetectionEvent) -> None:
        common = {"detection": event.kind.value, "cause": event.cause}
        if event.cause == FailStopCause.NODE_LOST:
            extra = {} if event.silent_s is None else {"silent_s": event.silent_s}
            self.events.emit("node_lost", node=event.node, reason=event.reason, **common, **extra)
            return
        inj = self._last_injection(event.rank)
        detect_s = (event.t - inj["t"]) if inj else None
        self.events.emit(
            "failure_detected",
            rank=event.rank,
            generation=event.generation,
            reason=event.reason,
            detect_s=detect_s,
            t_detected=event.t,
            returncode=event.returncode,
            silent_s=event.silent_s,
            **common,
        )
        self._last_failure_t = event.t
        self.fsm.note_progress(
            progressed=len(self._rows) > self._metrics_at_start, injected=inj is not None
        )
        self.progress.say(
            f"failure detected: rank {event.rank} {event.reason}"
            + (f" ({detect_s * 1000:.0f} ms after injection)" if detect_s is not None else "")
        )
        if inj is not None:
            self._pending_recoveries.append(inj)

    def _live(self, generation: int) -> bool:
        """A failure report concerns the running generation (not one being torn down)."""
        return generation == self.fsm.generation and self.fsm.state in (
            RecoveryState.RUNNING,
            RecoveryState.STARTING,
            RecoveryState.RESTARTING,
        )

    def _node_lost(self, reason: str, silent_s: float | None = None) -> None:
        self.emit(
            DetectionEvent(
                kind=DetectionKind.FAIL_STOP,
                cause=FailStopCause.NODE_LOST,
                rank=None,
                node=0,
                reason=reason,
                silent_s=silent_s,
            )
        )

    def _handle(self, conn: _Conn, msg: dict[str, Any]) -> None:
        op = msg["op"]
        if conn.is_agent or op == "hello":
            self._agent_seen = time.time()
        if op == "beat":
            if not conn.is_agent:
                raise ProtocolError("beat before hello")
            return
        if op == "hello":
            if self.agent is not None:
                raise ProtocolError("a second agent for node 0")
            conn.is_agent = True
            self.agent = conn
            self.events.emit("agent_joined", node=msg.get("node"), pid=msg.get("pid"))
            self._execute(self.fsm.begin())
            return
        if not conn.is_agent:
            raise ProtocolError(f"{op!r} before hello")
        if op == "started":
            if msg.get("promoted"):
                self.events.emit(
                    "shadows_promoted",
                    generation=msg["generation"],
                    ready=msg.get("shadows_ready", 0),
                    level=self.cfg.recovery.shadow_level,
                )
            if msg.get("shadows"):
                self.events.emit("shadows_spawned", **msg["shadows"])
            self.fsm.on_started(msg["generation"])
            self._log_transition()
        elif op == "rank_exit":
            code = msg["returncode"]
            if code == 0 or not self._live(msg["generation"]):
                self._execute(self.fsm.on_rank_exit(msg["rank"], msg["generation"], code))
                return
            said = msg.get("said") or ""
            self.emit(
                DetectionEvent(
                    kind=DetectionKind.FAIL_STOP,
                    cause=FailStopCause.EXIT,
                    rank=msg["rank"],
                    generation=msg["generation"],
                    node=0,
                    returncode=code,
                    t=msg["t"],
                    reason=f"exited with status {code}" + (f": {said}" if said else ""),
                )
            )
        elif op == "rank_hung":
            if not self._live(msg["generation"]):
                return
            self.emit(
                DetectionEvent(
                    kind=DetectionKind.FAIL_STOP,
                    cause=FailStopCause.HANG,
                    rank=msg["rank"],
                    generation=msg["generation"],
                    node=0,
                    silent_s=msg["silent_s"],
                    t=msg["t"],
                    reason=f"hung (silent {msg['silent_s']:.2f}s)",
                )
            )
        elif op == "stopped":
            self._execute(self.fsm.on_stopped(msg["generation"]))
        elif op == "memory":
            # The node's memory budget and reclamation controller (unbroken.shadow): logged
            # as events; a reclamation changes no recovery state.
            kind = msg.get("event")
            if kind not in MEMORY_EVENTS:
                raise ProtocolError(f"unknown memory event {kind!r}")
            fields = {k: v for k, v in msg.items() if k not in ("op", "event", "seq")}
            self.events.emit(kind, **fields)
            if kind == "shadows_reclaimed":
                freed = fields.get("freed_mb")
                self.progress.say(
                    f"memory: reclaimed {fields.get('shadows')} shadow(s)"
                    + (f", {freed:.0f} MiB" if isinstance(freed, (int, float)) else "")
                    + f" in {float(fields.get('wait_s') or 0) * 1e3:.0f} ms; relaunching at "
                    f"L{fields.get('level_to')}"
                )
            elif kind == "oom":
                self.progress.say(f"memory: out of budget with nothing to reclaim ({fields})")

    def _accept(self) -> None:
        try:
            sock, peer = self.listener.accept()
        except BlockingIOError:
            return
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sel.register(sock, selectors.EVENT_READ, _Conn(sock, peer, self.secret))

    def _drop(self, conn: _Conn, reason: str) -> None:
        self.events.emit("control_rejected", peer=str(conn.peer), reason=reason)
        self.progress.say(f"control channel: rejected {conn.peer}: {reason}")
        self.sel.unregister(conn.channel.sock)
        conn.channel.sock.close()
        if conn.is_agent:
            self.agent = None
            self._node_lost(reason)

    def _read(self, conn: _Conn) -> None:
        try:
            data = conn.channel.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._drop(conn, f"connection error: {exc}")
            return
        if not data:
            if conn.is_agent:
                self._drop(conn, "agent connection closed")
            else:
                self.sel.unregister(conn.channel.sock)
                conn.channel.sock.close()
            return
        try:
            for msg in conn.channel.feed(data):
                self._handle(conn, msg)
        except ProtocolError as exc:
            self._drop(conn, str(exc))
        except (KeyError, TypeError, ValueError) as exc:
            self._drop(conn, f"malformed message ({type(exc).__name__}: {exc})")

    def _poll_metrics(self) -> None:
        for t in self._timings_tail.read_new():
            if t.get("run") == self.run_name:
                self.slow_watch.add_timing(t)
        for m in self._metrics_tail.read_new():
            if m.get("run") != self.run_name:
                continue
            self._rows.append(m)
            self.progress.iteration(m)
            self._check_recovered(self._rows, m)
            self.slow_watch.add_metric(m)
        self.slow_watch.pump()

    def _check_recovered(self, rows: list[dict[str, Any]], m: dict[str, Any]) -> None:
        if not self._pending_recoveries:
            return
        inj = self._pending_recoveries[0]
        if m["iter"] < inj["iter"] or m["t_start"] <= inj["t"]:
            return
        self._pending_recoveries.pop(0)
        events = self._run_events()
        found = [
            r
            for r in analyze_run(rows, events)
            if r.iteration == inj["iter"] and r.rank == inj["rank"]
        ]
        if found:
            r = found[-1]
            restored = r.restored_iter
            self.events.emit(
                "recovery_done",
                mode=r.mode,
                rank=r.rank,
                detect_s=r.detect_s,
                init_s=r.init_s,
                recompute_s=r.recompute_s,
                total_s=r.total_s,
                resumed_iter=inj["iter"],
                restored_iter=restored,
            )
            self.progress.say(
                f"recovered ({r.mode}) at iteration {restored}: "
                f"detect {r.detect_s:.3f}s, init {r.init_s:.2f}s, "
                f"recompute {r.recompute_s:.2f}s, total {r.total_s:.2f}s"
            )

    # -- main loop ------------------------------------------------------------------------
    def run(self) -> RunOutcome:
        self._last_failure_t = 0.0
        self._agent_seen = time.time()
        self._start_services()
        self.events.emit("job_start", world_size=self.cfg.parallel.world_size, port=self.port)
        self.progress.say(
            f"starting {self.cfg.parallel.world_size} ranks "
            f"(recovery: {self.cfg.recovery.mode}, faults: {len(self.cfg.inject)})"
        )
        t_hello = time.time()
        try:
            while self.fsm.state not in (RecoveryState.DONE, RecoveryState.FAILED):
                for key, _ in self.sel.select(timeout=0.05):
                    if key.data is None:
                        self._accept()
                    else:
                        self._read(key.data)
                self._poll_metrics()
                if self.agent is None and time.time() - t_hello > HELLO_TIMEOUT_S:
                    self._node_lost("no agent connected")
                silent = time.time() - self._agent_seen
                if self.agent is not None and silent > self.cfg.recovery.node_timeout_s:
                    self._node_lost(f"beats stopped (agent silent for {silent:.1f}s)", silent)
                agent_gone = self.agent_proc is not None and self.agent_proc.poll() is not None
                if agent_gone and self.fsm.state not in (RecoveryState.DONE, RecoveryState.FAILED):
                    self._node_lost(f"agent exited with status {self.agent_proc.returncode}")
            self._poll_metrics()
        finally:
            self._shutdown()
        self.events.emit(
            "job_end",
            state=self.fsm.state.value,
            reason=self._done_reason,
            detector_s=self.slow_watch.overhead_s,
        )
        events = self._run_events()
        final = next(
            (e["final_state_hash"] for e in reversed(events) if e["kind"] == "trainer_done"), None
        )
        # Rows written after the last poll (a failed run's trainers are killed in _shutdown).
        late = [m for m in self._metrics_tail.read_new() if m.get("run") == self.run_name]
        metrics = self._rows + late
        return RunOutcome(
            run_name=self.run_name,
            state=self.fsm.state.value,
            generations=self.fsm.generation + 1,
            restarts=self.fsm.restarts,
            final_state_hash=final,
            reason=self._done_reason,
            metrics=metrics,
            events=events,
        )

    def _shutdown(self) -> None:
        if self.agent_proc is not None:
            try:
                self.agent_proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.agent_proc.kill()
                self.agent_proc.wait()
        for key in list(self.sel.get_map().values()):
            key.fileobj.close()
        self.sel.close()
