"""The coordinator's re-planning (issue 18, ResiHP §4/§7, Figure 8): the cluster as the
scheduler sees it, the placement the job runs, and the decisions to change it.

`Adaptation` keeps a `unbroken.plan.ClusterState` whose devices are the job's devices
(numbered as its ranks at launch) and whose plan is the data-parallel plan the job runs (one
single-device replica per rank; micro-batch ownership and migrations say who computes what).
Two reports change it:

- a lost device (`note_lost`, from the agent's health check): at the next generation start
  (`next_world`) the planner plans around every lost device of the running world; the
  survivors get ranks 0..n-1 in device order, the new `DataPlacement` gives them the lost
  replica's micro-batches, and the generation starts in place on their retained replicas — no
  checkpoint;
- devices back (`note_returned`, a lost node's agent joined again): once every device the job
  launched with is usable, the next generation (`next_world`) runs the launch world again with
  the launch placement; the returned ranks start with empty retained state and are filled from
  a data-parallel replica (`RankAction.FILL`). A partial return waits (its devices are kept as
  standbys);
- a validated fail-slow report with its measured factor (`on_fail_slow`): the planner's plan is
  published in the job store (`JobStore.publish_placement`) when it is predicted at least
  `adapt.min_gain` faster and the job has re-planned fewer than `adapt.max_replans` times; the
  ranks switch to it at an iteration boundary they agree on (`unbroken.launch.switch`);
- a slow device whose own work bounds the iteration even with no micro-batch on it (its
  optimizer step, stretched like its compute): taken out of the world, in place like a lost
  one, when that is predicted `adapt.min_gain` faster than the best plan that keeps it
  ([Note: slow device excluded]); it waits as a standby and is re-admitted on trial
  (`readmit_due`) `adapt.readmit_after` iterations later, doubling at each new exclusion;
- a slow rank at full speed again (`on_recovered`, from the fail-slow watch: it keeps a
  micro-batch, or, left none by ours ([Note: empty replica] in `unbroken.plan.balance`), runs
  a probe every `adapt.probe_every` iterations, so its pace stays measured): its device is
  healthy again and the
  plan for that state — the launch placement when nothing else is slow — is published the same
  way, so a false alarm or a passing slowdown costs a few iterations, not the rest of the run
  (counted against `adapt.max_replans` like the fail-slow re-plans, which bounds a job that
  switches back and forth).

[Note: slow device excluded] Emptied of micro-batches, a slow data-parallel rank still joins
the reduction and steps its whole replica, F x slower: with a step of a few micro-batches'
compute (the CPU bench model: 34 ms against 8 ms) a 6x device's step alone takes longer than
the other replicas' whole iteration, and the job runs at its pace (stop 46, `bench adapt`
DP = 4 severe: [6, 5, 5, 0] at 0.14-0.19 s an iteration against 0.07 s without the device). A
device outside the world costs nothing per iteration, but it cannot be probed there: it is
re-admitted on trial instead, as a device that came back (`note_returned`: the launch world
again, its rank filled from a replica, `RankAction.FILL`), and a device still slow is found
by the fail-slow watch (through its warm-up: `_slow_through_warmup`) and excluded again, its
wait doubled. Each exclusion counts against `adapt.max_replans`; a trial is made only while
the cap leaves room to exclude the device again, so a job never re-admits a slow device it
may not take out once more. Both moves are generation changes (a planned stop, in place, no
checkpoint), which the per-iteration prediction does not price; a job whose iterations are
short against a restart pays them in wall time, which `bench adapt` reports as reconfiguration
seconds. Only a job that retains its state (`recovery.mode = "inplace"`) under "resihp"
excludes; Greyhound's policy and evict-and-restart do not (the latter evicts for good).

Each decision is a `replan` event (trigger, placement before and after, the planner's
prediction before and after, its seconds) or a `replan_skipped` event with the reason. The
planner prices a data-parallel replica by its micro-batches (`Workload` with one layer, unit
costs): its decisions depend on relative speeds only; predicted seconds are reported scaled to
the job's measured healthy iteration time when the caller gives it. Pure decisions and the
store: no processes, no sockets.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from unbroken.config import JobConfig
from unbroken.detect.events import DetectionEvent
from unbroken.detect.pipeline import PlanFit
from unbroken.detect.workload import DataParallelFit
from unbroken.jobstore import JobStore
from unbroken.metrics.log import JsonlLog
from unbroken.parallel import DataPlacement, ParallelPlan, make_plan
from unbroken.plan import (
    ClusterState,
    DeviceStatus,
    Fabric,
    NoPlanError,
    PlannerConfig,
    PlanResult,
    Workload,
    plan_for_state,
)

__all__ = ["Adaptation", "Exclusion", "Exclusions", "NewWorld", "dp_cluster", "fail_slow_trigger"]

_UNIT_S = 1e-3
"""The planner's forward time of one micro-batch (a unit: only ratios are used)."""


def dp_cluster(shards: int, microbatches: int) -> ClusterState:
    """A healthy data-parallel job as the planner sees it: `shards` single-device replicas of
    `microbatches` micro-batches each, device d = replica d (one layer, unit costs, memory
    that never binds)."""
    workload = Workload(
        num_layers=1,
        tokens=1,
        sum_sq=1.0,
        alpha_s=_UNIT_S,
        beta_s=0.0,
        message_bytes=1.0,
        layer_params=1.0,
        act_bytes_per_layer=1.0,
    )
    fabric = Fabric(gpus_per_node=max(1, shards), intra_bytes_per_s=1e12, inter_bytes_per_s=1e12)
    plan = make_plan(shards, 1, 1, 1, microbatches)
    return ClusterState.healthy(plan, workload, fabric, memory_bytes=float(1 << 50))


@dataclass(frozen=True, slots=True)
class NewWorld:
    """What the next generation runs after a re-plan around lost devices."""

    devices: tuple[int, ...]
    """rank -> device."""
    placement: DataPlacement | None
    """Who computes which micro-batch (data-parallel jobs; None for a pipeline job's plan)."""
    epoch: int
    trial: tuple[int, ...] = ()
    """The slow devices it re-admits on trial ([Note: slow device excluded]): its fail-slow
    watch warms up quickly and holds their ranks to their peers through the warm-up
    (`SlowWatch.reset(trial=...)`)."""


@dataclass(frozen=True, slots=True)
class Exclusion:
    """A slow device out of the world ([Note: slow device excluded])."""

    trigger: dict
    """The fail-slow report's `replan` trigger."""
    since: int
    """The iteration its report was validated at."""
    readmit_at: int
    """The first iteration after which it is re-admitted on trial."""
    predicted_with: float
    """The planner's iteration with the device kept in the world (its units): the `replan`
    event's `predicted_before` (the running plan cannot be priced once the device is out)."""
    predicted_without: float | None = None
    """The planner's iteration without it, when the exclusion priced that plan itself (a
    pipeline job's dissolved replica; a data-parallel job re-plans at the generation start)."""


def fail_slow_trigger(event: DetectionEvent, devices: tuple[int, ...]) -> tuple[dict, int | None]:
    """The `replan` trigger of a fail-slow report, and the device of its rank in the running
    world `devices` (rank -> device; None when the report names no rank of it or no factor)."""
    trigger = {
        "kind": "fail_slow",
        "rank": event.rank,
        "factor": event.factor,
        "what": event.cause,
        "since_iter": event.iteration,
    }
    if event.rank is None or event.factor is None or not 0 <= event.rank < len(devices):
        return trigger, None
    trigger["device"] = devices[event.rank]
    return trigger, devices[event.rank]


class Exclusions(dict[int, Exclusion]):
    """device -> a slow device out of the world ([Note: slow device excluded]), with each
    device's next wait: the bookkeeping both adaptations (data-parallel, `Adaptation`;
    pipeline, `PipelineAdaptation`) share. Args: readmit_after (`adapt.readmit_after`, the
    first wait), events, say."""

    def __init__(self, readmit_after: int, events: JsonlLog, say: Callable[[str], None]) -> None:
        super().__init__()
        self.readmit_after, self.events, self.say = readmit_after, events, say
        self._wait: dict[int, int] = {}
        """device -> iterations its next exclusion waits before the trial re-admission."""

    def exclude(
        self,
        device: int,
        trigger: dict,
        iteration: int,
        predicted: tuple[float, float],
        scale: float,
        how: str = "",
    ) -> None:
        """`device` leaves the world at the next generation, reported slow at `iteration`
        (`trigger`); `predicted`: the planner's iteration with it and without it (its units;
        `scale`: the fault-free one). It is re-admitted on trial after its wait, which doubles
        at each exclusion; logs `device_excluded`."""
        with_s, without_s = predicted
        wait = self._wait.get(device, self.readmit_after)
        self._wait[device] = 2 * wait
        trigger = {**trigger, "excluded": True}
        self[device] = Exclusion(trigger, iteration, iteration + wait, with_s, without_s)
        self.events.emit(
            "device_excluded",
            device=device,
            trigger=trigger,
            predicted_with=_finite(with_s / scale),
            predicted_without=without_s / scale,
            readmit_at=iteration + wait,
        )
        self.say(
            f"exclude device {device} (slow {trigger['factor']:.2f}x): "
            + (f"{how}, " if how else "")
            + f"predicted iteration {without_s / scale:.2f}x the fault-free one without it, "
            f"{with_s / scale:.2f}x with it; re-admitted on trial after iteration "
            f"{iteration + wait}"
        )

    def readmit(
        self, devices: tuple[int, ...], iteration: int, returned: dict[int, str] | None
    ) -> tuple[int, ...]:
        """The devices outside the running world `devices` whose wait is over after
        `iteration`, moved to `returned` (offered to the next world) and logged
        (`device_readmitted`); in device order. `returned` None: devices standing by inside
        the world (a TP exclusion's, `PipelineAdaptation.benched`), `devices` not consulted."""
        due = sorted(
            d
            for d, x in self.items()
            if iteration >= x.readmit_at and (returned is None or d not in devices)
        )
        for d in due:
            x = self.pop(d)
            reason = f"re-admitted on trial ({iteration - x.since} iterations after its exclusion)"
            if returned is not None:
                returned[d] = reason
            self.events.emit("device_readmitted", device=d, iteration=iteration, reason=reason)
            self.say(f"device {d} {reason}")
        return tuple(due)

    def postpone(self, device: int, x: Exclusion, iteration: int, reason: str) -> None:
        """`device`, due for its trial after `iteration` (`x`: its exclusion, as `readmit`
        took it out), stays out for its next wait (which doubles, as an exclusion's does):
        nothing is known of its speed yet. Logs `readmit_postponed`."""
        wait = self._wait.get(device, self.readmit_after)
        self._wait[device] = 2 * wait
        self[device] = replace(x, readmit_at=iteration + wait)
        self.events.emit(
            "readmit_postponed",
            device=device,
            iteration=iteration,
            readmit_at=iteration + wait,
            reason=reason,
        )
        self.say(f"device {device} stays out until iteration {iteration + wait}: {reason}")


def _at_least_one(placement: DataPlacement) -> DataPlacement:
    """Every rank computes at least one micro-batch (a rank with none would skip the phase
    hooks its timings and faults key on): an idle rank takes the last id of the busiest."""
    items = [list(ids) for ids in placement.items]
    for ids in items:
        if not ids:
            busiest = max(items, key=len)
            ids.append(busiest.pop())
    return replace(placement, items=tuple(tuple(ids) for ids in items))


class Adaptation:
    """Args: cfg (the job), store (the job store; None in tests that do not publish), events
    (the run's event log), say (progress lines)."""

    def __init__(
        self,
        cfg: JobConfig,
        store: JobStore | None,
        events: JsonlLog,
        say: Callable[[str], None],
    ) -> None:
        self.cfg, self.store, self.events, self.say = cfg, store, events, say
        self.microbatches = cfg.data.microbatches
        shards = cfg.parallel.dp
        self.state = dp_cluster(shards, self.microbatches)
        self.devices: tuple[int, ...] = tuple(range(shards))
        """rank -> device, of the running world."""
        self.placement = DataPlacement.identity(shards, self.microbatches)
        self.epoch = 0
        self.replans = 0
        """Re-plans for slow devices so far (capped by `adapt.max_replans`)."""
        self.lost: dict[int, str] = {}
        """device -> why it is lost."""
        self.returned: dict[int, str] = {}
        """device -> why it is usable again (lost before; not yet back in the world)."""
        self.excluded = Exclusions(cfg.adapt.readmit_after, events, say)
        """device -> a slow device taken out of the world ([Note: slow device excluded])."""
        self._trial: tuple[int, ...] = ()
        """Slow devices the next world grown back re-admits on trial (`NewWorld.trial`)."""
        # Ours may leave a rank no micro-batch ([Note: empty replica] in
        # `unbroken.plan.balance`): the trainer runs it (no row in the ordered reduction, a
        # probe every `adapt.probe_every` iterations, `unbroken.train.Trainer._probe`).
        # Greyhound's `solve_dp` keeps one on every rank (`_at_least_one`).
        self.calibrated = False
        """Whether the scheduler prices with the job's measured costs (`calibrate`)."""
        self.planner = PlannerConfig(
            exclusion=cfg.adapt.policy != "greyhound",
            empty_replicas=cfg.adapt.policy == "resihp",
        )
        """The scheduler's steps: Greyhound's policy is the planner without exclusion."""
        self.healthy_s = plan_for_state(self.state, self.planner).current_s

    plan = None
    """The engine plan the job runs: none, the data-parallel trainer runs it."""
    relayout = False
    """Never: a data-parallel re-plan keeps every survivor's layout (its retained replica)."""
    reshard: ParallelPlan | None = None
    """Never: a data-parallel re-plan moves no layers (`PipelineAdaptation.reshard`)."""
    replay_next = False
    """Never: a data-parallel re-plan keeps the job's bits (the ordered reduction)."""

    def _placement(self, plan: ParallelPlan, devices: tuple[int, ...]) -> DataPlacement:
        """`plan`'s micro-batch ownership over `devices`; a rank the plan leaves none (an
        empty replica, or a device step 1 excluded) keeps none under ours, one under a
        policy whose planner keeps a micro-batch on every replica."""
        placement = DataPlacement.from_plan(plan, devices, self.microbatches)
        return placement if self.planner.empty_replicas else _at_least_one(placement)

    def calibrate(self, fit: PlanFit | DataParallelFit | None) -> None:
        """Price re-plans with the job's measured costs from now on, once (the first fit the
        fail-slow watch has: the launch placement's healthy warm-up): a micro-batch's
        forward + backward as the one layer's cost, and the per-iteration constant after the
        compute (`DataParallelFit.sync_s`) as each rank's optimizer step, which a slow
        device stretches and which a micro-batch left on it waits for ([Note: step lead] in
        `unbroken.plan.score`), and which every rank waits for at the boundary
        (`Workload.boundary_sync`: the ordered reduction's all-to-all and all-gather meet every
        iteration). An approximation: the constant holds the all-reduce and the sync too,
        which a slow device does not stretch (the wait is over-read by that share). Logs
        `replan_costs`."""
        if self.calibrated or not isinstance(fit, DataParallelFit) or fit.mb_s <= 0:
            return
        self.calibrated = True
        workload = replace(
            self.state.workload,
            alpha_s=fit.mb_s / (1.0 + self.state.workload.backward_ratio),
            step_s_per_param=fit.sync_s,  # one layer of one unit of parameters
            boundary_sync=True,
        )
        self.state = self.state.with_workload(workload)
        healthy = dp_cluster(self.cfg.parallel.dp, self.microbatches).with_workload(workload)
        self.healthy_s = plan_for_state(healthy, self.planner).current_s
        self.events.emit("replan_costs", microbatch_s=fit.mb_s, step_s=fit.sync_s)

    def spec_fields(self) -> dict:
        """The generation spec's fields of the running placement."""
        return {
            "placement": self.placement.to_dict() if self.epoch else None,
            "plan_epoch": self.epoch,
        }

    @property
    def evicts(self) -> bool:
        """Evict-and-restart (`adapt.policy = "evict"`): a slow device is excluded, not planned
        around, and the job restarts from a checkpoint on the others."""
        return self.cfg.adapt.policy == "evict"

    # -- reports ----------------------------------------------------------------------------
    def device_of(self, rank: int) -> int:
        return self.devices[rank]

    def note_lost(self, device: int, reason: str) -> None:
        """The agent found `device` lost: no later generation runs on it."""
        if device not in self.lost:
            self.lost[device] = reason
            self.state = self.state.with_lost(device)

    def note_returned(self, devices: list[int], reason: str) -> None:
        """`devices` (lost before) are usable again: offered to the next world."""
        for d in devices:
            if self.lost.pop(d, None) is not None:
                self.returned[d] = reason
        self.state = self.state.with_healthy(*devices)

    @property
    def grows(self) -> bool:
        """Whether the next world will be larger: every launch device is usable again and some
        of them are outside the running world."""
        return bool(self.returned) and not self.lost and not self.excluded

    @property
    def restarts(self) -> bool:
        """Whether the running generation should stop for the next: the world grows back, or
        a slow device leaves it."""
        return self.grows or self.excluding

    @property
    def excluding(self) -> bool:
        """Whether a slow device of the running world is to leave it at the next generation."""
        return any(d in self.excluded for d in self.devices)

    def next_world(self, iter_s: float | None = None) -> NewWorld | None:
        """At a generation start: the world without the lost devices, or the launch world once
        returned devices complete it (None: unchanged).

        Raises:
            NoPlanError: no device is left.
        """
        gone = [d for d in self.devices if d in self.lost or d in self.excluded]
        if not gone:
            return self._grow() if self.grows else None
        before = self.placement
        result = plan_for_state(self.state, self.planner)
        plan = result.plan()
        devices = tuple(sorted(plan.ranks))
        placement = self._placement(plan, devices)
        lost = [d for d in gone if d in self.lost]
        if lost:
            trigger = {"kind": "device_lost", "devices": lost, "reason": self.lost[lost[0]]}
        else:  # a slow device leaves the world ([Note: slow device excluded])
            trigger = self.excluded[gone[0]].trigger
            result = replace(result, current_s=self.excluded[gone[0]].predicted_with)
        self._adopt(result, plan, devices, placement, trigger, before, iter_s)
        return NewWorld(devices, placement, self.epoch)

    def _grow(self) -> NewWorld:
        """The launch world again (every device back): its plan and placement, a `replan`
        event whose trigger names the returned devices."""
        shards = self.cfg.parallel.dp
        back = sorted(self.returned)
        reason = self.returned[back[0]]
        self.returned.clear()
        before, devices_before = self.placement, self.devices
        self.state = self.state.with_plan(make_plan(shards, 1, 1, 1, self.microbatches))
        self.devices = tuple(range(shards))
        self.placement = DataPlacement.identity(shards, self.microbatches)
        self.epoch += 1
        if self.store is not None:
            self.store.publish_placement(self.epoch, json.dumps(self.placement.to_dict()))
        trigger = {"kind": "devices_returned", "devices": back, "reason": reason}
        self.events.emit(
            "replan",
            epoch=self.epoch,
            trigger=trigger,
            devices_before=list(devices_before),
            devices_after=list(self.devices),
            before=before.to_dict(),
            after=self.placement.to_dict(),
            counts_before=list(before.counts()),
            counts_after=list(self.placement.counts()),
            predicted_before=None,
            predicted_after=None,
            predicted_before_s=None,
            predicted_after_s=None,
            plan_s=0.0,
            explain="every device the job launched with is back: the launch plan",
        )
        self.say(
            f"re-plan (devices returned {back}): devices {list(devices_before)} -> "
            f"{list(self.devices)}, micro-batches per rank {list(before.counts())} -> "
            f"{list(self.placement.counts())}"
        )
        trial, self._trial = self._trial, ()
        return NewWorld(self.devices, self.placement, self.epoch, trial)

    def on_fail_slow(self, event: DetectionEvent, iter_s: float | None = None) -> bool:
        """A validated fail-slow report (rank in the running world, measured factor): publish
        a faster placement if there is one and the job may re-plan. Returns whether it did."""
        trigger, device = fail_slow_trigger(event, self.devices)
        if device is None:
            return self._skip(trigger, "the report names no rank of the running world")
        if self.replans >= self.cfg.adapt.max_replans:
            return self._skip(trigger, f"adapt.max_replans = {self.cfg.adapt.max_replans} reached")
        if self.evicts:
            return self._evict(device, trigger)
        self.state = self.state.apply(replace(event, rank=device))
        try:
            result = plan_for_state(self.state, self.planner)
        except NoPlanError as exc:  # pragma: no cover - a slow device never empties the plan
            return self._skip(trigger, str(exc))
        if self._exclude(device, result, trigger, event.iteration):
            return True
        gain = 1.0 - result.predicted_s / result.current_s
        if result.kept_current or gain < self.cfg.adapt.min_gain:
            return self._skip(
                trigger, f"predicted gain {gain:.1%} < adapt.min_gain {self.cfg.adapt.min_gain:.0%}"
            )
        plan = result.plan()
        placement = self._placement(plan, self.devices)
        self.replans += 1
        self._adopt(result, plan, self.devices, placement, trigger, self.placement, iter_s)
        return True

    def on_recovered(self, rank: int, factor: float, iter_s: float | None = None) -> bool:
        """Rank `rank`, re-planned around as slow, runs at `factor` x its peers' pace again:
        its device is healthy in the cluster state and the planner's plan for that state (the
        launch placement when every device is healthy) is published like a fail-slow re-plan.
        Counted against `adapt.max_replans` like a fail-slow re-plan: on a machine whose ranks
        share cores, a rank with fewer micro-batches computes each faster, a moderate slowdown
        can look recovered, and the job could otherwise switch back and forth for ever.
        Returns whether it re-planned."""
        trigger = {"kind": "speed_recovered", "rank": rank, "factor": factor}
        if not 0 <= rank < len(self.devices):
            return self._skip(trigger, "the report names no rank of the running world")
        device = self.devices[rank]
        trigger["device"] = device
        if self.state.device(device).status is not DeviceStatus.SLOW:
            return self._skip(trigger, f"device {device} is not marked slow")
        if self.replans >= self.cfg.adapt.max_replans:
            return self._skip(trigger, f"adapt.max_replans = {self.cfg.adapt.max_replans} reached")
        self.state = self.state.with_healthy(device)
        result = plan_for_state(self.state, self.planner)
        plan = result.plan()
        placement = self._placement(plan, self.devices)
        if placement == self.placement:
            return self._skip(trigger, "the plan for the healthy device is the running one")
        self.replans += 1
        self._adopt(result, plan, self.devices, placement, trigger, self.placement, iter_s)
        return True

    @property
    def excludes(self) -> bool:
        """Whether a slow device may leave the world ([Note: slow device excluded])."""
        adapt = self.cfg.adapt
        return (
            adapt.policy == "resihp"
            and adapt.readmit_after > 0
            and self.cfg.recovery.mode == "inplace"
        )

    def _exclude(self, device: int, kept: PlanResult, trigger: dict, iteration: int) -> bool:
        """Take slow `device` out of the world when that is predicted `adapt.min_gain` faster
        than `kept` (the best plan with it); the next generation runs without it (`restarts`,
        `next_world`). Returns whether it did."""
        alive = [d for d in self.devices if d not in self.lost and d not in self.excluded]
        if not self.excludes or len(alive) < 2:
            return False
        without = self.state.with_lost(device)
        try:
            result = plan_for_state(without, self.planner)
        except NoPlanError:  # pragma: no cover - another device is left
            return False
        if result.predicted_s > kept.predicted_s * (1.0 - self.cfg.adapt.min_gain):
            return False
        self.replans += 1
        self.excluded.exclude(
            device, trigger, iteration, (kept.predicted_s, result.predicted_s), self.healthy_s
        )
        self.state = without
        return True

    def readmit_due(self, iteration: int) -> bool:
        """After `iteration`: re-admit, on trial, excluded devices whose wait is over, while
        `adapt.max_replans` leaves room to exclude one again ([Note: slow device excluded]).
        Returns whether one was (the caller stops the running generation: `restarts`)."""
        if self.replans >= self.cfg.adapt.max_replans:
            return False
        due = self.excluded.readmit(self.devices, iteration, self.returned)
        if not due:
            return False
        self.state = self.state.with_healthy(*due)
        self._trial = due
        return True

    def _evict(self, device: int, trigger: dict) -> bool:
        """Evict-and-restart: `device` leaves the job like a lost one (the next generation's
        world is planned without it, `next_world`); the caller restarts from a checkpoint. The
        device stays excluded for the rest of the run (the baseline re-admits nothing)."""
        if sum(d not in self.lost for d in self.devices) <= 1:
            return self._skip(trigger, "the last device of the job is not evicted")
        self.replans += 1
        self.note_lost(device, f"evicted: {trigger['factor']:.2f}x slower ({trigger['what']})")
        self.events.emit("device_evicted", device=device, trigger=trigger)
        self.say(
            f"evict device {device} (slow {trigger['factor']:.2f}x): restart from a checkpoint"
        )
        return True

    # -- decisions --------------------------------------------------------------------------
    def _adopt(
        self,
        result: PlanResult,
        plan: ParallelPlan,
        devices: tuple[int, ...],
        placement: DataPlacement,
        trigger: dict,
        before: DataPlacement,
        iter_s: float | None,
    ) -> None:
        devices_before = self.devices
        self.state = self.state.with_plan(plan)
        self.devices, self.placement = devices, placement
        self.epoch += 1
        if self.store is not None:
            self.store.publish_placement(self.epoch, json.dumps(placement.to_dict()))
        scale = (iter_s / self.healthy_s) if iter_s else None
        self.events.emit(
            "replan",
            epoch=self.epoch,
            trigger=trigger,
            devices_before=list(devices_before),
            devices_after=list(devices),
            before=before.to_dict(),
            after=placement.to_dict(),
            counts_before=list(before.counts()),
            counts_after=list(placement.counts()),
            predicted_before=_finite(result.current_s),
            predicted_after=result.predicted_s,
            predicted_before_s=_finite(result.current_s * scale) if scale else None,
            predicted_after_s=result.predicted_s * scale if scale else None,
            plan_s=result.planning_s,
            explain=result.explain(),
        )
        was = (
            f", was {result.current_s / self.healthy_s:.2f}x"
            if math.isfinite(result.current_s)
            else ""
        )
        self.say(
            f"re-plan ({trigger['kind']}): devices {list(devices_before)} -> {list(devices)}, "
            f"micro-batches per rank {list(before.counts())} -> {list(placement.counts())}; "
            f"predicted iteration {result.predicted_s / self.healthy_s:.2f}x the fault-free "
            f"one{was} (planned in {result.planning_s * 1e3:.0f} ms)"
        )

    def _skip(self, trigger: dict, reason: str) -> bool:
        self.events.emit("replan_skipped", trigger=trigger, reason=reason)
        self.say(f"no re-plan for {trigger['kind']}: {reason}")
        return False


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None
