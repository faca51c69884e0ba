"""The coordinator's core: the recovery state machine (`unbroken.recovery.RecoveryMachine`) and
the executor of its actions, fed by typed messages from the node agents.

It is the `DetectionSink` of every failure decision: an agent's `RankExited` and `RankHung`
and its own node-loss decisions become `DetectionEvent(kind=FAIL_STOP)`, the fail-slow watch's
reports arrive as `FAIL_SLOW`; each is written to the event log and handed to the machine. Its
actions become commands to the nodes of the `NodeLayout` (each node gets its own ranks) and
generation specs that carry the recovery decision (`RestoreMode`) and the job's endpoints.

Every decision is taken from messages and the job store, never from a log the run writes: the
crash-loop rule reads the failing rank's last completed iteration from its `RankExited` and
whether a scheduled fault fired from the store (`JobStore.fault_fired_at`). No sockets, no
processes: `send` is the only way out, so the core is tested by feeding it messages.

With `adapt.enabled` it also follows the scheduler (`launch.coordinator.adapt`, issue 18): a
rank whose device the agent found lost (`RankExited.device_lost`) is recovered on the remaining
devices — the next generation runs fewer ranks, each on its old device and state manager
(`GenerationSpec.devices`), with a placement that gives them the lost replica's micro-batches;
a validated fail-slow report publishes a faster placement in the job store, which the ranks
adopt at an iteration boundary. Ranks are numbered 0..n-1 in every generation; devices keep
the numbers of the ranks at launch.
"""

from __future__ import annotations

import shutil
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from unbroken.checkpoint.dcp import checkpoint_root
from unbroken.config import JobConfig, to_dict
from unbroken.detect.events import DetectionEvent, DetectionKind, FailStopCause
from unbroken.devices import DeviceRegistry
from unbroken.inject import parse_fault
from unbroken.jobstore import JobStore
from unbroken.launch.coordinator.adapt import Adaptation
from unbroken.launch.coordinator.adapt_plan import PipelineAdaptation
from unbroken.launch.coordinator.crashloop import CrashLoopWatch
from unbroken.launch.coordinator.monitor import RunMonitor
from unbroken.launch.coordinator.nodes import Endpoints, NodeLayout
from unbroken.launch.coordinator.replay import ReplayPoint, keep_newest_checkpoint
from unbroken.launch.spec import GenerationSpec
from unbroken.messages import (
    Hello,
    MemoryReport,
    Message,
    NodeBeat,
    RankExited,
    RankHung,
    ShadowPlan,
    Shutdown,
    Started,
    StartGeneration,
    StopGeneration,
    Stopped,
)
from unbroken.metrics.log import JsonlLog
from unbroken.plan import NoPlanError
from unbroken.recovery import (
    Action,
    Fail,
    Finish,
    RankExit,
    RecoveryMachine,
    RecoveryState,
    RestoreMode,
    Start,
    Stop,
)

__all__ = ["STARTUP_WINDOW_S", "CoordinatorCore", "startup_error"]

STARTUP_WINDOW_S = 3.0
"""How long a rank's failure before its first iteration is held, waiting for its peers: if
every rank fails the same way within it, the failure is deterministic and the job stops."""


def startup_error(said: str) -> str:
    """A rank's last words without the rank: equal for every rank of a deterministic failure
    ("unbroken-trainer[rank 1] in attach: error: ..." -> "in attach: error: ...")."""
    head, sep, rest = said.partition("] ")
    return rest if sep and head.startswith("unbroken-trainer[rank ") else said


def _adaptation(
    cfg: JobConfig, store: JobStore | None, events: JsonlLog, monitor: RunMonitor, search: list[str]
) -> Adaptation | PipelineAdaptation | None:
    """How the job follows the scheduler (`adapt.enabled`): the data-parallel adaptation, or
    a pipeline job's (`parallel.pp` > 1; the config admits TP = 1 only)."""
    if not cfg.adapt.enabled:
        return None
    if not cfg.parallel.planned:
        return Adaptation(cfg, store, events, monitor.say)
    from unbroken.engine.build import job_plan

    plan = job_plan(cfg, search)
    assert plan is not None  # planned
    moves_layers = cfg.recovery.mode == "inplace" and cfg.adapt.policy == "resihp"
    return PipelineAdaptation(
        plan, events, monitor.say, store, cfg.adapt, moves_layers=moves_layers
    )


def _machine(cfg: JobConfig, world_size: int, retains_state: bool) -> RecoveryMachine:
    """The run's recovery state machine: re-planning around lost devices unless the job does
    not adapt or follows Greyhound's policy (no answer to them); evict-and-restart under
    `adapt.policy = "evict"`."""
    adapt = cfg.adapt
    return RecoveryMachine(
        world_size=world_size,
        max_restarts=cfg.recovery.max_restarts,
        retains_state=retains_state,
        replans=adapt.enabled and adapt.policy != "greyhound",
        evicts=adapt.enabled and adapt.policy == "evict",
    )


class CoordinatorCore:
    """Args: cfg, run_dir, run_name, layout (ranks per node), endpoints (where the store
    listens), send (`(node, message)` to an agent), events (the run's event log), monitor
    (the run monitor, told of each detected failure), store (the job store; None in tests
    without fault injection), search_path, debug (tracebacks of failed ranks on the terminal),
    start (a replaying reference run's start: its plan, from the kept checkpoint; None: the
    config's plan, fresh)."""

    def __init__(
        self,
        cfg: JobConfig,
        run_dir: Path,
        run_name: str,
        *,
        layout: NodeLayout,
        endpoints: Endpoints,
        send: Callable[[int, Message], None],
        events: JsonlLog,
        monitor: RunMonitor,
        store: JobStore | None,
        search_path: list[str] | None = None,
        debug: bool = False,
        start: ReplayPoint | None = None,
    ) -> None:
        self.cfg, self.run_dir, self.run_name, self.start = cfg, run_dir, run_name, start
        self.layout, self.endpoints = layout, endpoints
        self.send, self.events, self.monitor, self.store = send, events, monitor, store
        self.search_path, self.debug = search_path or [], debug
        self.retains_state = cfg.recovery.mode == "inplace"
        self.fsm = _machine(cfg, layout.world_size, self.retains_state)
        self.adapt = _adaptation(cfg, store, events, monitor, self.search_path)
        self.devices: tuple[int, ...] = tuple(range(layout.world_size))
        """rank -> device of the running world (devices are numbered as the ranks at launch)."""
        self._worlds: dict[int, tuple[int, ...]] = {}
        """generation -> its rank -> device (a late report names a rank of its own world)."""
        self.registry = run_dir / "devices" / run_name
        """The CPU devices' health (`unbroken.devices`), fresh for every run."""
        shutil.rmtree(self.registry, ignore_errors=True)
        self.registry.mkdir(parents=True)
        self.joined: dict[int, float] = {}
        """node -> when it was last heard from."""
        self.gone: set[int] = set()
        """Nodes lost (fenced: nothing of theirs is accepted, unless a fresh agent of the node
        joins again and the job re-plans: `readmit`)."""
        self.launch_nodes = layout.node_ids
        """The nodes the job launched with (the layout shrinks with lost nodes)."""
        first_spare = max(layout.node_ids) + 1
        self.spare_ids = tuple(range(first_spare, first_spare + cfg.nodes.spares))
        """Nodes that may join beyond the launch (`nodes.spares`) to stand in for lost ones."""
        self.standby: dict[int, Hello] = {}
        """Joined nodes that hold no device (spares, and lost nodes back after a spare took
        their devices): the next lost node's devices go to the lowest of them."""
        self._grow_pending = False
        self.node_of_device = {d: layout.node_of(d) for d in range(layout.world_size)}
        """device -> its node (devices are numbered as the ranks at launch)."""
        self.done_reason = ""
        self._begun = False
        self._started: dict[int, set[int]] = {}
        self._shadows_for: dict[int, int] = {}
        """node -> the generation its last beat had a live shadow of every rank for (-1)."""
        self._stopped: dict[int, set[int]] = {}
        self._last_failure_t = 0.0
        self._faults = [parse_fault(s) for s in cfg.inject]
        self._held: dict[int, tuple[int, RankExited]] = {}
        self._crash_loops = CrashLoopWatch()
        """rank -> (node, its exit) of start-up failures held in the window."""
        self._held_until: float | None = None
        self._reshard_gen: int | None = None  # the last generation started in RESHARD mode
        self._reshard_progressed = False  # a failure of it reported a completed iteration

    # -- nodes ----------------------------------------------------------------------------
    def handle(self, node: int, msg: Message) -> None:
        """A validated message from `node`'s agent.

        Raises:
            ValueError: `node` is not in the job's layout.
        """
        if node not in self.launch_nodes and node not in self.spare_ids:
            raise ValueError(
                f"node {node} is not in the job's layout {self.launch_nodes} "
                f"(spare nodes: {list(self.spare_ids) or 'none, nodes.spares = 0'})"
            )
        claimed = msg.generation if isinstance(msg, Hello | NodeBeat) else -1
        if claimed > self.fsm.generation:
            raise ValueError(
                f"node {node} claims generation {claimed}; the job is at {self.fsm.generation}"
            )
        self.joined[node] = time.time()
        if isinstance(msg, Hello):
            if self._hosts_devices(node):
                self._hello(node, msg)
            else:
                self._standby(node, msg)
        elif isinstance(msg, NodeBeat):
            self._shadows_for[node] = msg.shadows_for
            return
        elif isinstance(msg, Started):
            self._started_on(node, msg)
        elif isinstance(msg, RankExited):
            self._rank_exited(node, msg)
        elif isinstance(msg, RankHung):
            self._rank_hung(node, msg)
        elif isinstance(msg, Stopped):
            self._stopped_on(node, msg)
        elif isinstance(msg, MemoryReport):
            self._memory(msg)

    def _hello(self, node: int, msg: Hello) -> None:
        self.events.emit("agent_joined", node=node, pid=msg.pid, host=msg.host)
        if not self._begun and set(self.joined) >= set(self.live_nodes):
            self._begun = True
            self.execute(self.fsm.begin())

    @property
    def live_nodes(self) -> tuple[int, ...]:
        """The layout's nodes that are not lost."""
        return tuple(n for n in self.layout.node_ids if n not in self.gone)

    def give_up(self, reason: str) -> None:
        self.execute(self.fsm.give_up(reason))

    def node_lost(self, node: int, reason: str, silent_s: float | None = None) -> None:
        """`node` is gone with every process on it: its devices are lost hardware. A job that
        re-plans (`adapt`) stops the generation on the other nodes and continues without it;
        else the job fails. Its late messages are refused from now on (`gone`)."""
        if node in self.gone:
            return
        if node in self.standby:  # a spare in waiting: nothing of the job runs there
            del self.standby[node]
            self.joined.pop(node, None)
            self.events.emit("spare_lost", node=node, reason=reason)
            self.monitor.say(f"spare node {node} lost ({reason}); it held no devices")
            return
        self.gone.add(node)
        if self.adapt is not None and node in self.layout.node_ids:
            for rank in self.layout.ranks_of(node):
                self.adapt.note_lost(self.devices[rank], f"node {node} lost: {reason}")
        # A spare in waiting takes the lost devices at once: the recovery's next generation
        # runs the launch world on it (`Adaptation.next_world`), no smaller world between.
        while self._use_spare():
            pass
        self.emit(
            DetectionEvent(
                kind=DetectionKind.FAIL_STOP,
                cause=FailStopCause.NODE_LOST,
                rank=None,
                node=node,
                reason=reason,
                silent_s=silent_s,
            )
        )

    def readmit(self, node: int, hello: Hello) -> bool:
        """A fresh agent of lost node `node` joined (its host came back, or it was restarted):
        with `adapt` its devices are offered to the scheduler, which grows the world back at
        the next generation — started now by a planned stop when the job is running, else as
        soon as it is. Returns False (the caller fences it) when the job does not re-plan or
        is over, or when the agent is not fresh: one that ran a generation of this job
        (`Hello.generation`) reconnects after a partition, and that generation's processes
        may still run on its node."""
        if self.adapt is None or node not in self.launch_nodes or self.fsm.over:
            return False
        if hello.generation >= 0:
            return False
        self.gone.discard(node)
        self.joined[node] = time.time()
        if not self._hosts_devices(node):  # a spare took its devices: it waits as one
            self._standby(node, hello)
            return True
        devices = sorted(d for d, n in self.node_of_device.items() if n == node)
        self.adapt.note_returned(devices, f"node {node} returned")
        self.events.emit(
            "node_returned", node=node, pid=hello.pid, host=hello.host, devices=devices
        )
        self.monitor.say(f"node {node} returned ({hello.host}): devices {devices} offered")
        self._grow_pending = self.adapt.restarts
        self._grow()
        return True

    def _hosts_devices(self, node: int) -> bool:
        return node in self.node_of_device.values()

    def _standby(self, node: int, hello: Hello) -> None:
        """A node with no device joined (a spare, or a lost node whose devices a spare took):
        it waits, and stands in for the next lost node; at once if one is lost now."""
        self.standby[node] = hello
        self.events.emit("spare_joined", node=node, pid=hello.pid, host=hello.host)
        self.monitor.say(f"node {node} joined as a spare ({hello.host})")
        if self._use_spare():
            self._grow_pending = self.adapt is not None and self.adapt.restarts
            self._grow()

    def _use_spare(self) -> bool:
        """The lowest spare in waiting takes the devices of the lowest lost node that still
        owns some (`adapt`): they are offered to the scheduler as returned, with their
        records in the device registry cleared (the slot is the spare's hardware now).
        Returns whether one did."""
        if self.adapt is None or self.fsm.over or not self.standby:
            return False
        orphaned = sorted({n for n in self.node_of_device.values() if n in self.gone})
        if not orphaned:
            return False
        lost, spare = orphaned[0], min(self.standby)
        hello = self.standby.pop(spare)
        devices = sorted(d for d, n in self.node_of_device.items() if n == lost)
        registry = DeviceRegistry(self.registry)
        for d in devices:
            self.node_of_device[d] = spare
            registry.clear(d)
        self.adapt.note_returned(devices, f"spare node {spare} replaces lost node {lost}")
        self.events.emit(
            "spare_promoted", node=spare, replaces=lost, devices=devices, host=hello.host
        )
        self.monitor.say(f"spare node {spare} ({hello.host}) takes lost node {lost}'s {devices}")
        return True

    def _grow(self) -> None:
        """Stop the running generation for the next world (a larger one, or a plan that moves
        layers), once it runs."""
        if not self._grow_pending:
            return
        reason = "devices returned: re-plan onto the larger world"
        if self.adapt is not None and self.adapt.excluding:
            reason = "a slow device leaves the world: the next generation runs without it"
        elif self.adapt is not None and not self.adapt.grows:
            reason = "re-plan moves layers: the next generation moves the state"
        action = self.fsm.on_grow(reason)
        if action is not None:
            self._grow_pending = False
            self.execute(action)

    def _started_on(self, node: int, msg: Started) -> None:
        if msg.promoted:
            self.events.emit(
                "shadows_promoted",
                node=node,
                generation=msg.generation,
                ready=msg.shadows_ready,
                level=self.cfg.recovery.shadow_level,
            )
        if msg.shadows is not None:
            s = msg.shadows
            fields = {"level": s.level, "generation": s.generation, "start": s.start}
            if s.fork_failed:
                fields["fork_failed"] = s.fork_failed
            self.events.emit("shadows_spawned", node=node, **fields)
        started = self._started.setdefault(msg.generation, set())
        started.add(node)
        if started >= set(self.live_nodes):
            self.fsm.on_started(msg.generation)
            self._log_transitions()
            if self.adapt is not None and not self.adapt.restarts:
                self._grow_pending = False  # this generation already runs the next world
            self._grow()

    def _stopped_on(self, node: int, msg: Stopped) -> None:
        stopped = self._stopped.setdefault(msg.generation, set())
        stopped.add(node)
        if stopped >= set(self.live_nodes):
            self.execute(self.fsm.on_stopped(msg.generation))

    def _live(self, generation: int) -> bool:
        """A failure report concerns the running generation (not one being torn down)."""
        return generation == self.fsm.generation and self.fsm.state in (
            RecoveryState.RUNNING,
            RecoveryState.STARTING,
            RecoveryState.RESTARTING,
        )

    def _rank_exited(self, node: int, msg: RankExited) -> None:
        world = self._worlds.get(msg.generation, self.devices)
        if msg.returncode != 0 and 0 <= msg.rank < len(world):
            self._crash_loops.exited(msg.generation, world[msg.rank], msg.returncode, msg.said)
        if msg.device_lost and self.adapt is not None and 0 <= msg.rank < len(world):
            self.adapt.note_lost(world[msg.rank], msg.device_lost)  # even if stale: never again
        if msg.returncode == 0 or not self._live(msg.generation):
            self.execute(self.fsm.on_rank_exit(msg.rank, msg.generation, msg.returncode))
            return
        if msg.returncode == RankExit.FALLBACK:
            # Not a new failure: the in-place recovery of the last one gave up (its retained
            # state is beyond repair); the same recovery continues from a checkpoint.
            self.events.emit("recovery_fallback", rank=msg.rank, generation=msg.generation)
            self.execute(self.fsm.on_rank_exit(msg.rank, msg.generation, msg.returncode))
            return
        if (
            not msg.device_lost
            and msg.iteration < 0
            and self._injected_since_last_failure() is None
        ):
            self._hold(node, msg)  # before its first iteration: wait for its peers
            return
        self._fail_stop_exit(node, msg)

    def _hold(self, node: int, msg: RankExited) -> None:
        self._held[msg.rank] = (node, msg)
        if self._held_until is None:
            self._held_until = time.time() + STARTUP_WINDOW_S
        if len(self._held) == self.layout.world_size:
            self.tick(float("inf"))

    def tick(self, now: float) -> None:
        """Re-admit excluded slow devices whose wait is over (`_readmit`); release the held
        start-up failures once every rank failed or the window passed: the same error on
        every rank fails the job at once; else the first is recovered."""
        self._readmit()
        if self._held_until is None or (
            now < self._held_until and len(self._held) < self.layout.world_size
        ):
            return
        held = [self._held[r] for r in sorted(self._held)]
        self._held, self._held_until = {}, None
        node, first = min(held, key=lambda h: h[1].t)
        errors = {startup_error(m.said) for _, m in held}
        if not self._live(first.generation):
            return
        if len(held) == self.layout.world_size and len(errors) == 1 and first.said:
            log = Path(self.run_dir) / "logs" / self.run_name
            log = log / f"gen{first.generation}-rank{first.rank}.log"
            reason = (
                f"every rank failed before its first iteration: {errors.pop()} (traceback: {log})"
            )
            self._fail_stop_exit(node, first, startup=reason)
        else:
            self._fail_stop_exit(node, first)

    def _readmit(self) -> None:
        """A slow device excluded for long enough is re-admitted on trial: a planned stop,
        then the launch world ([Note: slow device excluded] in `unbroken.launch.coordinator.
        adapt`)."""
        if self.adapt is None or self.fsm.state is not RecoveryState.RUNNING:
            return
        rows = self.monitor.rows
        if rows and self.adapt.readmit_due(int(rows[-1]["iter"])):
            self._grow_pending = True
            self._grow()

    def _fail_stop_exit(self, node: int, msg: RankExited, startup: str = "") -> None:
        if msg.traceback and self.debug:
            self.monitor.say(f"rank {msg.rank} traceback:\n{msg.traceback.rstrip()}")
        lost = f"; {msg.device_lost}" if msg.device_lost else ""
        self.emit(
            DetectionEvent(
                kind=DetectionKind.FAIL_STOP,
                cause=FailStopCause.DEVICE_LOST if msg.device_lost else FailStopCause.EXIT,
                rank=msg.rank,
                generation=msg.generation,
                node=node,
                returncode=msg.returncode,
                iteration=msg.iteration,
                t=msg.t,
                reason=f"exited with status {msg.returncode}"
                + (f": {msg.said}" if msg.said else "")
                + lost,
            ),
            progressed=msg.completed >= 0,
            phase=msg.phase,
            startup=startup,
        )

    def _conclude_crash_loop(self, failed_generation: int) -> None:
        """Before the generation after a failure starts: a device whose trainers keep dying
        before any progress is lost hardware when the job re-plans (`CrashLoopWatch`) —
        recorded in the device registry (no generation starts on it again) and handed to the
        adaptation, which plans around it."""
        found = self._crash_loops.conclude(failed_generation)
        if found is None or self.adapt is None or not self.fsm.replans:
            return
        device, reason = found
        DeviceRegistry(self.registry).mark_lost(device, reason)
        self.adapt.note_lost(device, reason)
        self.fsm.loop_explained()
        self.events.emit("device_crash_loop", device=device, reason=reason)
        self.monitor.say(f"device {device} lost: {reason}")

    def _rank_hung(self, node: int, msg: RankHung) -> None:
        if not self._live(msg.generation):
            return
        self.emit(
            DetectionEvent(
                kind=DetectionKind.FAIL_STOP,
                cause=FailStopCause.HANG,
                rank=msg.rank,
                generation=msg.generation,
                node=node,
                silent_s=msg.silent_s,
                iteration=msg.iteration,
                t=msg.t,
                reason=f"hung (silent {msg.silent_s:.2f}s)",
            ),
            progressed=msg.completed >= 0,
            phase=msg.phase,
        )

    def _memory(self, msg: MemoryReport) -> None:
        """The node's memory budget and reclamation controller (unbroken.shadow): logged as
        events; a reclamation changes no recovery state."""
        fields = msg.fields
        self.events.emit(msg.event, t=msg.t, **{"node_generation": msg.generation, **fields})
        if msg.event == "shadows_reclaimed":
            freed = fields.get("freed_mb")
            self.monitor.say(
                f"memory: reclaimed {fields.get('shadows')} shadow(s)"
                + (f", {freed:.0f} MiB" if isinstance(freed, int | float) else "")
                + f" in {float(fields.get('wait_s') or 0) * 1e3:.0f} ms; relaunching at "
                f"L{fields.get('level_to')}"
            )
        elif msg.event == "oom":
            self.monitor.say(f"memory: out of budget with nothing to reclaim ({fields})")

    # -- detection ------------------------------------------------------------------------
    def emit(
        self, event: DetectionEvent, progressed: bool = True, phase: str = "", startup: str = ""
    ) -> None:
        """`DetectionSink`: log a detected failure, then let the recovery machine act on it
        (`startup`: the reason every rank failed the same way before its first iteration)."""
        if event.kind is DetectionKind.FAIL_STOP:
            self._log_fail_stop(event, progressed, phase)
        elif self.adapt is not None and self.fsm.state is RecoveryState.RUNNING:
            self.adapt.calibrate(self.monitor.slow_watch.fit)
            acted = self.adapt.on_fail_slow(event, self._healthy_iter_s(event.iteration))
            if acted and self.adapt.restarts:  # layers move: at a planned stop
                self._grow_pending = True
                self._grow()
            elif acted and self.adapt.plan is not None:  # a pipeline's live plan: watch it
                self.monitor.slow_watch.reset(len(self.devices), self.adapt.plan, same_ranks=True)
            if acted and self.adapt.evicts:
                self.execute(
                    self.fsm.on_evict(f"rank {event.rank} runs {event.factor:.2f}x slower")
                )
        action = self.fsm.on_startup_failure(startup) if startup else self.fsm.on_detection(event)
        self.execute(action)  # to the live nodes only: a lost node's agent is gone
        if event.cause == FailStopCause.NODE_LOST:
            self._stopped_without_lost()

    def on_speed_recovered(self, rank: int, factor: float, iteration: int) -> None:
        """The fail-slow watch saw a rank reported slow run at its peers' pace (a one-replica
        pipeline's: its own healthy pace per layer) again: with re-planning on, its device is
        offered back to the plan (`Adaptation.on_recovered`); layers it gave away come back at
        a planned stop, as they left."""
        if self.adapt is not None and self.fsm.state is RecoveryState.RUNNING:
            acted = self.adapt.on_recovered(rank, factor, self._healthy_iter_s(iteration))
            if acted and self.adapt.restarts:  # layers move back: at a planned stop
                self._grow_pending = True
                self._grow()
            elif acted and self.adapt.plan is not None:  # back toward the launch plan, live
                self.monitor.slow_watch.reset(len(self.devices), self.adapt.plan, same_ranks=True)

    def _stopped_without_lost(self) -> None:
        """A node lost while the generation was stopping: the other nodes may all have
        stopped already (the lost one never will)."""
        gen = self.fsm.generation
        if self.fsm.state is RecoveryState.STOPPING and self._stopped.get(gen, set()) >= set(
            self.live_nodes
        ):
            self.execute(self.fsm.on_stopped(gen))

    def faults_fired(self) -> int:
        """How many scheduled faults have fired (each left its marker in the store)."""
        if self.store is None:
            return 0
        return sum(self.store.fault_fired_at(f.key) is not None for f in self._faults)

    def _injected_since_last_failure(self) -> tuple[float, str] | None:
        """(time, spec) of the newest scheduled fault that fired since the previous failure,
        from the job store (the injector marks a fault there before it acts)."""
        if self.store is None:
            return None
        fired = []
        for fault in self._faults:
            t = self.store.fault_fired_at(fault.key)
            if t is not None and t > self._last_failure_t:
                fired.append((t, fault.text()))
        return max(fired) if fired else None

    def _log_fail_stop(self, event: DetectionEvent, progressed: bool, phase: str) -> None:
        common = {"detection": event.kind.value, "cause": event.cause}
        if event.cause == FailStopCause.NODE_LOST:
            extra = {} if event.silent_s is None else {"silent_s": event.silent_s}
            self.events.emit(
                "node_lost",
                node=event.node,
                reason=event.reason,
                t_detected=event.t,
                **common,
                **extra,
            )
            self.monitor.say(f"node {event.node} lost: {event.reason}")
            self.monitor.failure_detected(event.t)
            return
        injected = self._injected_since_last_failure()
        detect_s = (event.t - injected[0]) if injected else None
        self.events.emit(
            "failure_detected",
            rank=event.rank,
            node=event.node,
            generation=event.generation,
            reason=event.reason,
            detect_s=detect_s,
            t_detected=event.t,
            returncode=event.returncode,
            silent_s=event.silent_s,
            iter=event.iteration,
            phase=phase,
            injected=injected[1] if injected else None,
            **common,
        )
        self._last_failure_t = event.t
        if event.generation == self._reshard_gen and progressed:
            self._reshard_progressed = True
        # A lost device explains its failure: not a stall of the job's crash-loop rule.
        explained = injected is not None or event.cause == FailStopCause.DEVICE_LOST
        self.fsm.note_progress(progressed=progressed, injected=explained)
        if event.generation is not None:
            self._crash_loops.failed(event.generation, progressed, injected is not None)
        self.monitor.say(
            f"failure detected: rank {event.rank} {event.reason}"
            + (f" ({detect_s * 1000:.0f} ms after injection)" if detect_s is not None else "")
        )
        self.monitor.failure_detected(event.t)

    def _healthy_iter_s(self, before: int | None = None) -> float | None:
        """The median iteration time of the last rows before iteration `before` (the monitor's
        record: it scales the planner's predictions in the `replan` event, no decision)."""
        rows = [m for m in self.monitor.rows if before is None or m["iter"] < before]
        times = [m["iter_s"] - m.get("ckpt_s", 0.0) for m in rows[-10:]]
        return statistics.median(times) if times else None

    # -- actions --------------------------------------------------------------------------
    def _socket(self, device: int) -> str:
        root = self.run_dir / "rmp"
        root.mkdir(exist_ok=True)
        return str(root / f"{self.run_name}-rank{device}.sock")

    def _state_sockets(self) -> dict[str, str]:
        """rank -> the state manager socket of its device (in-place mode)."""
        if not self.retains_state:
            return {}
        return {str(r): self._socket(d) for r, d in enumerate(self.devices)}

    def write_spec(
        self, generation: int, restore: RestoreMode, plan_before: dict | None = None
    ) -> Path:
        spec = GenerationSpec(
            config=to_dict(self.cfg),
            run_dir=str(self.run_dir),
            run_name=self.run_name,
            store_host=self.endpoints.host,
            store_port=self.endpoints.store_port,
            generation=generation,
            world_size=self.layout.world_size,
            restore=restore,
            retains_state=self.retains_state,
            search_path=self.search_path,
            state_sockets=self._state_sockets(),
            debug=self.debug,
            devices=list(self.devices),
            **(self.adapt.spec_fields() if self.adapt else self._start_fields()),
            plan_before=plan_before,
            device_registry=str(self.registry),
        )
        path = self.run_dir / "specs" / f"{self.run_name}-gen{generation}.json"
        path.parent.mkdir(exist_ok=True)
        path.write_text(spec.to_json())
        return path

    def _start_fields(self) -> dict[str, Any]:
        """The spec's plan of a run that does not re-plan: a replaying reference's plan."""
        return {"plan": self.start.plan} if self.start is not None else {}

    def _keep_replay_point(self, generation: int) -> None:
        """The world of `generation` changes the job's bits ([Note: replayed plan change] in
        `unbroken.launch.coordinator.adapt_plan`): keep the checkpoint it loads and log where
        the reference replays the change from."""
        assert self.adapt is not None and self.adapt.plan is not None
        root = checkpoint_root(self.cfg.checkpoint.dir, self.run_dir, self.run_name)
        dest = self.run_dir / "replay" / self.run_name / f"gen{generation}"
        iteration = keep_newest_checkpoint(root, dest)
        point = ReplayPoint(
            generation=generation,
            iteration=iteration,
            plan=self.adapt.plan.to_dict(),
            world=len(self.devices),
            checkpoint_dir=str(dest) if iteration else None,
        )
        self.events.emit("replay_point", **point.to_event())

    def execute(self, action: Action | None) -> None:
        if isinstance(action, Start):
            self._start(action)
        elif isinstance(action, Stop):
            for node in self.live_nodes:
                self.send(node, StopGeneration(generation=action.generation))
        elif isinstance(action, Finish | Fail):
            self.done_reason = action.reason
            for node in (*self.live_nodes, *sorted(self.standby)):
                self.send(node, Shutdown(generation=self.fsm.generation))
        self._log_transitions()

    def _new_world(self) -> bool:
        """Before a generation starts: plan around lost devices (`adapt`). Returns whether the
        world changed (its shadows, prepared for the old one, cannot take over)."""
        if self.adapt is None:
            return False
        world = self.adapt.next_world(self._healthy_iter_s())
        if world is None:
            return False
        # Layers moved on the same devices keep every rank's number: the watch keeps the
        # slow rank's report (and healthy pace) to find it back at full speed.
        same_ranks = world.devices == self.devices
        moved = {i: self.devices.index(d) for i, d in enumerate(world.devices) if d in self.devices}
        self.devices = world.devices
        self.layout = NodeLayout.for_devices(world.devices, self.node_of_device)
        self.fsm.resize(len(world.devices))
        trial = tuple(world.devices.index(d) for d in world.trial if d in world.devices)
        self.monitor.slow_watch.reset(
            len(world.devices), self.adapt.plan, same_ranks=same_ranks, trial=trial, moved=moved
        )
        return True

    def _restore_for(self, action: Start, changed: bool) -> tuple[Start, dict | None]:
        """How the generation of `action` obtains its state when the world or plan changed,
        and the plan its devices' state holds when it moves that state itself (RESHARD). A
        failure of a RESHARD generation before a completed iteration (`_reshard_progressed`:
        then every rank had moved its state) may leave the ranks' regions in two layouts:
        the next one restarts from the checkpoint. A RESHARD generation that rank 0 logged an
        iteration of had moved it too: one stopped for a second move (layers given back to a
        device at full speed again) is the next one's plan before."""
        unfinished = (
            self._reshard_gen is not None
            and action.generation == self._reshard_gen + 1
            and not self._reshard_progressed
            and not any(m.get("generation") == self._reshard_gen for m in self.monitor.rows)
            and action.restore is RestoreMode.IN_PLACE
        )
        before = self.adapt.reshard if changed and self.adapt is not None else None
        if before is not None:
            self.adapt.reshard = None
        relayout = changed and self.adapt is not None and self.adapt.relayout
        if relayout or unfinished or (before is not None and not self.retains_state):
            # The survivors' retained state holds another plan's layout (or, after a failure
            # while moving it, a mix of two): checkpoint, resharded.
            if self.adapt is not None:
                self.adapt.relayout = False
            return replace(action, restore=RestoreMode.CHECKPOINT), None
        if before is not None and action.restore is RestoreMode.IN_PLACE:
            self._reshard_gen, self._reshard_progressed = action.generation, False
            return replace(action, restore=RestoreMode.RESHARD), before.to_dict()
        return action, None

    def _start(self, action: Start) -> None:
        if action.generation > 0:
            self._conclude_crash_loop(action.generation - 1)
        try:
            changed = self._new_world()
        except NoPlanError as exc:
            self.execute(self.fsm.give_up(f"no devices left to re-plan on: {exc}"))
            return
        self._worlds[action.generation] = self.devices
        action, plan_before = self._restore_for(action, changed)
        if changed and self.adapt is not None and self.adapt.replay_next:
            self.adapt.replay_next = False
            self._keep_replay_point(action.generation)
        if action.generation == 0 and self.start is not None and self.start.checkpoint_dir:
            action = replace(action, restore=RestoreMode.CHECKPOINT)
        spec = self.write_spec(action.generation, action.restore, plan_before)
        if action.generation > 0:
            self.events.emit(
                "recovery_start", mode=action.restore.value, generation=action.generation
            )
        shadows = None
        if self.retains_state and self.cfg.recovery.shadow_level:
            nxt = self.write_spec(action.generation + 1, RestoreMode.IN_PLACE)
            shadows = ShadowPlan(
                level=self.cfg.recovery.shadow_level,
                start=self.cfg.recovery.shadow_start,
                next_spec=str(nxt),
                attempt=action.generation + 1,
            )
        sockets = self._state_sockets()
        rec = self.cfg.recovery
        regroup = self._regroup(action.generation, changed)
        for node in self.live_nodes:
            ranks = self.layout.ranks_of(node)
            devices = {str(r): self.devices[r] for r in ranks}
            self.send(
                node,
                StartGeneration(
                    generation=action.generation,
                    spec=str(spec),
                    ranks=list(ranks),
                    heartbeat_timeout_s=rec.heartbeat_timeout_s,
                    node_heartbeat_s=rec.node_heartbeat_s,
                    shadows=shadows,
                    memory_budget_mb=rec.memory_budget_mb,
                    memory_reclaim=rec.memory_reclaim,
                    state_managers={
                        str(self.devices[r]): sockets[str(r)] for r in ranks if str(r) in sockets
                    },
                    log_dir=str(self.run_dir / "logs" / self.run_name),
                    debug=self.debug,
                    devices=devices,
                    device_registry=str(self.registry),
                    world_changed=changed,
                    regroup=regroup,
                ),
            )

    def _regroup(self, generation: int, changed: bool) -> bool:
        """Whether shadows promoted into `generation` must leave their set's group for the
        generation's own rendezvous: on several nodes, when some node's last beat did not have
        a live shadow for each of its ranks — that node starts fresh trainers (its fork server
        still importing, say), and promoted L3 shadows kept in their mirror world would wait
        there for its shadows until the collective timeout. One node decides alone, and a
        changed world regroups anyway (`Promote.regroup`, as_rank)."""
        nodes = self.live_nodes
        if len(nodes) < 2 or changed or generation == 0:
            return False
        if all(self._shadows_for.get(n) == generation for n in nodes):
            return False
        self.events.emit(
            "shadows_regroup",
            generation=generation,
            shadows_for={str(n): self._shadows_for.get(n, -1) for n in nodes},
        )
        return True

    def _log_transitions(self) -> None:
        while self.fsm.transitions:
            old, new, reason = self.fsm.transitions.pop(0)
            self.events.emit("state", old=old, new=new, reason=reason, **self.fsm.snapshot())
