"""The coordinator's re-planning of a pipeline job (issue 18) around lost and slow devices.

`Adaptation` (`adapt.py`) re-plans data-parallel jobs, whose survivors keep their retained
replicas. A plan job (`parallel.pp` or `parallel.tp` > 1) is re-planned here:

- **Another replica holds every stage** (DP x PP): the scheduler (`plan_for_state`) dissolves
  the replica that lost a device and gives its micro-batches to the replicas left; its other
  devices become standbys (outside the world). Every surviving rank keeps the layers it held,
  so the next generation restores **in place** from the retained state, without a checkpoint;
  the ordered reduction (`unbroken.engine.ordered_plan`) makes the new plan compute the
  launch plan's bits. A TP-2 group that lost one device is shrunk to its peer instead when
  the job retains its state and that is predicted `adapt.min_gain` faster (`_regroup`,
  `unbroken.launch.coordinator.adapt_lost`: the peer's stage moves to it from a whole
  replica, `RestoreMode.RESHARD`). A plan that moves layers onto a surviving rank (not what
  the scheduler returns for a lost device today) restarts from the checkpoint instead,
  resharded.
- **A stage lost its only copy** (one replica, or every replica of a stage lost): the
  scheduler has no plan (`NoPlanError`); `shrink_pipeline` gives the survivors an even pipeline
  of one replica, and the next generation starts from the newest checkpoint resharded to it
  (`unbroken.engine.ckpt_layout`, `RestoreMode.CHECKPOINT`); the survivors' state managers give
  their regions the new geometry.

- **A slow device** (`on_fail_slow`, DP x PP): the scheduler's steps that keep every rank's
  layers (micro-batch ownership and stage migrations between replicas, `_LIVE`) plan around
  it; a plan predicted `adapt.min_gain` faster is published in the job store and every rank
  switches to it at the same iteration boundary (`unbroken.launch.switch`), on its own state.

- **A slow device out of the world** (DP x PP, ours with retained state, `_exclude`): emptied
  of micro-batches, a slow device still steps its stage and its stage's reduction waits for
  it. When the plan without it — its replica dissolved as for a lost device, the survivors in
  place — is predicted `adapt.min_gain` faster than the best live plan, it leaves at a planned
  stop (`restarts`), stands by with its replica's other devices, and is re-admitted on trial
  after `adapt.readmit_after` iterations (`readmit_due`: the launch world again, `_grow`), as
  the data-parallel job does ([Note: slow device excluded] in
  `unbroken.launch.coordinator.adapt`).

- **A slow stage of a one-replica pipeline, with a standby** (`_swap`: a replica was
  dissolved before, so an alive device stands outside the world): when the running plan at
  full speed is predicted `adapt.min_gain` faster than the best plan keeping the device, the
  standby takes its stage at a planned stop, from the newest checkpoint (no replica holds the
  stage's current state); the slow device is excluded like above.

- **A slow device, layers moved** (`moves_layers`: the job retains its state; a plan with
  layer repartition (ResiHP §6.2) predicted `adapt.min_gain` faster than the best plan that
  keeps every rank's layers — in a DP x PP job typically the slow replica's layers alone, its
  replicas then in two layouts, which the ordered reduction folds per parameter): the plan is
  adopted at a planned stop (`restarts`), and the next generation runs it on the same devices
  in `RestoreMode.RESHARD`: each rank reattaches its retained state of the plan before,
  brings it to the boundary in place, and the ranks move parameters and optimizer moments to
  the new layout between them (`unbroken.launch.relayout`), no checkpoint.

- **A slow device's TP group shrunk** (DP x TP, ours with retained state, `_SHRINK`, stop
  49): the scheduler's exclusion step (ResiHP §6.1) shrinks a TP-2 group around its slow
  device to TP 1; the plan is taken like a layer move (a planned stop, `RestoreMode.RESHARD`)
  when every stage keeps the launch plan's bits (`emulates`: the TP-1 stage computes as the
  group did, `unbroken.engine.emulate`). The device stays in the world as a rank of no stage
  (`benched`) and is re-admitted on trial after `adapt.readmit_after` iterations
  (`_readmit_benched`: the launch plan, moved back the same way).

The plan of a lost device travels in the generation spec (`GenerationSpec.plan`), its ranks
numbered 0..n-1 in the survivors' device order. A slow device at full speed again
(`on_recovered`) is healthy in the cluster state again: in a DP x PP job (the fail-slow watch
compared it with its stages' holders in the other replicas, per layer) it gets its micro-batches
back, live, the same way they left, or its layers when they moved; in a one-replica pipeline (the watch held it to its own compute
per layer before the slowdown, `unbroken.detect.pipeline.LayerPace`) the scheduler's plan with
layer repartition gives its layers back the way they left (`_layers_back`: a planned stop,
`RestoreMode.RESHARD`, no checkpoint). Both count against `adapt.max_replans`.

[Note: replayed plan change] Every plan above computes the launch plan's bits (the ordered
reduction folds per micro-batch, a TP-1 stage computes as a TP-2 group), so the run is audited
against a fault-free reference on the launch plan. A job left with fewer survivors than its TP
degree (above 2) cannot keep them: `_shrink` runs the largest power-of-two TP degree the
survivors hold, from the newest checkpoint, and that change is *replayed* — the `replan` event
says `replayed`, the coordinator keeps the checkpoint the generation loads (a `replay_point`
event, `unbroken.launch.coordinator.replay`), and the fault-free reference is run again from
that checkpoint under the new plan (`unbroken.api`); the faulty run must match the reference
before the change and its replay after it. `bits_tp` is the degree whose bits the job computes
from then on: the scheduler's later plans keep those, and growing back to the launch plan
changes them again (from the checkpoint, replayed too).

Decisions, the event log and the job store's plan key: no processes, no sockets of its own.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from unbroken.config import AdaptConfig
from unbroken.detect.events import DetectionEvent
from unbroken.detect.pipeline import PlanFit
from unbroken.detect.workload import DataParallelFit
from unbroken.jobstore import JobStore
from unbroken.launch.coordinator.adapt import Exclusions, NewWorld, fail_slow_trigger
from unbroken.launch.coordinator.adapt_costs import cluster, keeps_stages, measured_workload
from unbroken.launch.coordinator.adapt_lost import emulates, regroup_lost, relabeled, renumbered
from unbroken.metrics.log import JsonlLog
from unbroken.parallel import ParallelPlan, same_layouts
from unbroken.plan import (
    DeviceStatus,
    NoPlanError,
    PlannerConfig,
    PlanResult,
    plan_for_state,
)
from unbroken.plan.shrink import dissolve_replicas, shrink_pipeline

__all__ = ["PipelineAdaptation", "emulates"]

_LIVE = PlannerConfig(exclusion=False, repartition=False)
"""The scheduler's steps a running pipeline job follows at a boundary around a slow device:
micro-batch ownership and stage migrations between replicas (ResiHP §6.3), which keep every
rank's layers and state. Excluding the device or moving layers needs the live reshard."""

_MOVE = PlannerConfig(exclusion=False)
"""The same plus layer repartition (ResiHP §6.2): layers move between the stages of a replica,
so the ranks' state moves with them (a planned restart in `RestoreMode.RESHARD`)."""

_SHRINK = PlannerConfig()
"""Every step, selective TP exclusion (ResiHP §6.1) first: a slow device's TP group shrinks
to its fast devices, the excluded one stays in the world as a standby of the plan (no
actions), and the ranks' state moves to the new layout like a repartition's. Taken only when
every stage keeps the launch plan's bits (`emulates`)."""


def _planner(config: PlannerConfig, adapt: AdaptConfig) -> PlannerConfig:
    """`config` for this job's policy: ours may empty a replica ([Note: empty replica] in
    `unbroken.plan.balance`; its devices probed, `unbroken.engine.probe`); Greyhound's
    `solve_dp` keeps at least one micro-batch per replica."""
    return replace(config, empty_replicas=adapt.policy == "resihp")


class PipelineAdaptation:
    """The `Adaptation` interface for a pipeline job. Args: plan (the launch plan, ranks =
    devices), events, say, store (the job store a live plan is published in; None in tests
    that do not publish), adapt (`adapt.max_replans`, `adapt.min_gain`)."""

    def __init__(
        self,
        plan: ParallelPlan,
        events: JsonlLog,
        say: Callable[[str], None],
        store: JobStore | None = None,
        adapt: AdaptConfig | None = None,
        *,
        moves_layers: bool = False,
    ) -> None:
        self.plan, self.events, self.say = plan, events, say
        self.moves_layers = moves_layers
        """Whether a slow device may be planned around by moving layers (the job retains its
        state, so the moved layers come from the ranks' retained buffers)."""
        self.store, self.adapt = store, adapt or AdaptConfig(enabled=True)
        self.devices: tuple[int, ...] = tuple(sorted(plan.ranks))
        """rank -> device, of the running world."""
        self.state = cluster(plan)
        """The running plan as the scheduler sees it, slow ranks marked (ranks of the plan)."""
        self.healthy_s = plan_for_state(self.state).current_s
        self.replans = 0
        """Re-plans for slow devices so far (capped by `adapt.max_replans`)."""
        self.epoch = 0
        self.lost: dict[int, str] = {}
        self.launch, self.launch_devices = plan, self.devices
        """The plan the job launched with, and its devices: what a job grows back to."""
        self.returned: dict[int, str] = {}
        """device -> why it is usable again (lost before; not in the running world)."""
        self.relayout = False
        """The plan of the next generation differs from the one the survivors' state holds:
        they start from a checkpoint (read and cleared by the coordinator)."""
        self.reshard: ParallelPlan | None = None
        """The plan the survivors' state holds when the next generation moves it to the new
        plan's layout itself (`RestoreMode.RESHARD`; read and cleared by the coordinator)."""
        self.launch_tp = max(g.tp for rep in plan.replicas for g in rep.stages)
        """The launch plan's TP degree (its largest, were they mixed)."""
        self.bits_tp = self.launch_tp
        """The TP degree whose bits the job computes ([Note: replayed plan change]): the launch
        degree until a lost device leaves fewer survivors than it."""
        self.replay_next = False
        """The next generation's plan changes the job's bits: it starts from the newest
        checkpoint, which the coordinator keeps for the reference's replay (read and cleared
        by the coordinator)."""
        self._moving: tuple[PlanResult, ParallelPlan, dict, float | None] | None = None
        """A fail-slow re-plan that moves layers, waiting for the planned stop."""
        self.calibrated = False
        """Whether the scheduler prices with the job's measured costs (`calibrate`)."""
        self.excluded = Exclusions(self.adapt.readmit_after, events, say)
        """device -> a slow device taken out of the world ([Note: slow device excluded] in
        `unbroken.launch.coordinator.adapt`; here its replica is dissolved, `_exclude`, or a
        standby takes its stage, `_swap`)."""
        self.benched = Exclusions(self.adapt.readmit_after, events, say)
        """device -> a slow device a TP exclusion (`_SHRINK`) left standing by inside the
        world, a rank of no stage: re-admitted on trial after its wait (`readmit_due`)."""
        self.evicted: set[int] = set()
        """Devices evicted for being slow (`_evict`): the next world is a fresh even plan from
        the checkpoint (`_shrink`), not the survivors in place."""
        self._trial: tuple[int, ...] = ()
        """Slow devices the next world grown back re-admits on trial (`NewWorld.trial`)."""

    # -- reports ----------------------------------------------------------------------------
    def note_lost(self, device: int, reason: str) -> None:
        self.lost.setdefault(device, reason)
        self.benched.pop(device, None)  # a standby lost: nothing to re-admit

    def note_returned(self, devices: list[int], reason: str) -> None:
        """Lost devices usable again. Back before the world shrank (a spare node took them at
        once), the running plan keeps them; once it shrank, they are offered back: when every
        launch device is usable again the next generation runs the launch plan (`grows`)."""
        for d in devices:
            if self.lost.pop(d, None) is not None and d not in self.devices:
                self.returned[d] = reason

    @property
    def grows(self) -> bool:
        """Whether the next world is the launch one again: every launch device is usable (none
        lost, none excluded) and some of them are outside the running world."""
        return (
            bool(self.returned)
            and not self.lost
            and not self.excluded
            and self.devices != self.launch_devices
        )

    @property
    def restarts(self) -> bool:
        """Whether the running generation should stop for the next (a planned stop, not a
        failure): the world grows back, a re-plan moves layers, or a slow device leaves."""
        return self.grows or self._moving is not None or self.excluding

    @property
    def evicts(self) -> bool:
        """Evict-and-restart (`adapt.policy = "evict"`, Oobleck-like): a slow device leaves
        the job like a lost one, and the next generation starts from the newest checkpoint on
        the others (the recovery machine's `on_evict` forces the checkpoint)."""
        return self.adapt.policy == "evict"

    @property
    def excluding(self) -> bool:
        """Whether a slow device of the running world is to leave it at the next generation."""
        return any(d in self.excluded for d in self.devices)

    @property
    def excludes(self) -> bool:
        """Whether a slow device may leave the world: ours with retained state (the survivors
        restore in place; `moves_layers` says both) and `adapt.readmit_after` > 0."""
        return self.moves_layers and self.adapt.readmit_after > 0

    def calibrate(self, fit: PlanFit | DataParallelFit | None) -> None:
        """Price re-plans with the job's measured costs (`measured_workload`) from now on:
        once, from the first fit the fail-slow watch has (the launch plan's healthy warm-up;
        a later one may have been fitted with a slow device in it). Logs `replan_costs`."""
        if self.calibrated or not isinstance(fit, PlanFit):
            return
        workload = measured_workload(self.plan, fit)
        if workload is None:
            return
        self.calibrated = True
        self.state = self.state.with_workload(workload)
        self.healthy_s = plan_for_state(cluster(self.launch, workload)).current_s
        self.events.emit(
            "replan_costs",
            layer_forward_s=workload.alpha_s,
            head_s=workload.head_s,
            backward_ratio=workload.backward_ratio,
            step_s=fit.step_s,
            microbatch_s=fit.mb_s,
        )

    def on_fail_slow(self, event: DetectionEvent, iter_s: float | None = None) -> bool:
        """A validated fail-slow report (rank of the running world, measured factor): publish
        the scheduler's plan that moves micro-batches off the slow replica — every rank keeps
        its layers, so the job switches at an iteration boundary on its own state
        (`unbroken.launch.switch`). Returns whether it re-planned."""
        trigger, device = fail_slow_trigger(event, self.devices)
        if device is None:
            return self._skip(trigger, "the report names no rank of the running world")
        if self.replans >= self.adapt.max_replans:
            return self._skip(trigger, f"adapt.max_replans = {self.adapt.max_replans} reached")
        if self.evicts:
            return self._evict(device, trigger)
        if self.plan.dp == 1 and not self.moves_layers:
            return self._skip(
                trigger,
                "a pipeline of one replica has no replica to move micro-batches to, and its "
                "layers move only when the job retains its state (recovery.mode = inplace)",
            )
        if self._moving is not None:
            return self._skip(trigger, "a re-plan that moves layers is waiting for its stop")
        self.state = self.state.apply(event)
        result, moves = self._best_plan()
        if self._exclude(event.rank, result, trigger, event.iteration):
            return True
        if self._swap(event.rank, result, trigger, event.iteration):
            return True
        gain = 1.0 - result.predicted_s / result.current_s
        if result.kept_current or gain < self.adapt.min_gain:
            return self._skip(
                trigger, f"predicted gain {gain:.1%} < adapt.min_gain {self.adapt.min_gain:.0%}"
            )
        if moves:
            self._bench(result, trigger, event.iteration)
            self._decide_move(result, trigger, iter_s)
            return True
        self._adopt_live(result, result.plan(), trigger, iter_s)
        return True

    def _bench(self, result: PlanResult, trigger: dict, iteration: int) -> None:
        """The running plan's devices that `result`'s plan leaves without a stage (a TP
        exclusion, `_SHRINK`) stand by inside the world — ranks of no stage, joining only the
        job's world-wide collectives — and are re-admitted on trial after their wait
        (`readmit_due`), which doubles at each exclusion."""
        plan = result.plan()
        for r in self.plan.ranks:
            if r not in plan.ranks:
                self.benched.exclude(
                    self.devices[r],
                    trigger,
                    iteration,
                    (result.current_s, result.predicted_s),
                    self.healthy_s,
                    "its TP group shrinks to the others (computing as the group did); it "
                    "stands by in the world",
                )

    def _evict(self, device: int, trigger: dict) -> bool:
        """Evict-and-restart: `device` leaves the job like a lost one (the next generation is
        planned without it, `next_world`, and starts from the newest checkpoint: the caller
        stops the running one through `RecoveryMachine.on_evict`). It stays out for the rest
        of the run."""
        if len(self.devices) - sum(d in self.lost for d in self.devices) <= 1:
            return self._skip(trigger, "the last device of the job is not evicted")
        self.replans += 1
        self.evicted.add(device)
        self.note_lost(device, f"evicted: {trigger['factor']:.2f}x slower ({trigger['what']})")
        self.events.emit("device_evicted", device=device, trigger=trigger)
        self.say(
            f"evict device {device} (slow {trigger['factor']:.2f}x): restart from a checkpoint"
        )
        return True

    def _decide_move(
        self, result: PlanResult, trigger: dict, iter_s: float | None, count: bool = True
    ) -> None:
        """A re-plan that moves layers: counted now (unless a trial re-admission, `count`),
        adopted at the planned stop (`restarts`, then `_move_layers` at the next generation's
        start)."""
        self.replans += count
        self._moving = (result, result.plan(), trigger, iter_s)
        self.say(
            f"re-plan ({trigger['kind']}, rank {trigger['rank']} {trigger['factor']:.2f}x): "
            "moves layers; stopping at the next boundary to move the state"
        )

    def _best_plan(self) -> tuple[PlanResult, bool]:
        """The scheduler's plan for the current state and whether it moves layers: the best
        plan that keeps every rank's layers, unless moving layers is allowed and predicted
        `adapt.min_gain` faster still. The scheduler's repartition of a DP x PP job moves the
        slow replica's layers alone; the ordered reduction folds each parameter over its
        holders, wherever they hold it (`unbroken.engine.ordered_plan`), so such a plan runs
        bit-exactly too."""
        keep = plan_for_state(self.state, _planner(_LIVE, self.adapt))
        if not self.moves_layers:
            return keep, False
        best, moves = keep, False
        bar = keep.predicted_s * (1.0 - self.adapt.min_gain)
        shrinks = self.excludes and any(
            g.tp > 1 for rep in self.launch.replicas for g in rep.stages
        )
        for config in (_MOVE, _SHRINK) if shrinks else (_MOVE,):
            found = plan_for_state(self.state, _planner(config, self.adapt))
            plan = found.plan()
            if found.kept_current or keeps_stages(self.plan, self.devices, plan, self.devices):
                continue
            if config is _SHRINK and not emulates(
                self.launch, plan, len(self.devices), self.bits_tp
            ):
                continue
            if found.predicted_s < min(bar, best.predicted_s if moves else bar):
                best, moves = found, True
        return best, moves

    def _adopt_live(
        self,
        result: PlanResult,
        plan: ParallelPlan,
        trigger: dict,
        iter_s: float | None,
        restore: str = "live",
    ) -> None:
        """Make `plan` the running one: publish it for the boundary switch (`restore` "live";
        "reshard": the next generation runs it), log `replan`."""
        before = self.plan
        self.plan, self.state = plan, self.state.with_plan(plan)
        self.epoch += 1
        if restore == "live":
            self.replans += 1  # a re-plan that moves layers was counted when it was decided
            if self.store is not None:
                self.store.publish_placement(self.epoch, json.dumps({"plan": plan.to_dict()}))
        scale = iter_s / self.healthy_s if iter_s else None
        self.events.emit(
            "replan",
            epoch=self.epoch,
            trigger=trigger,
            devices_before=list(self.devices),
            devices_after=list(self.devices),
            before=before.stage_records(),
            after=plan.stage_records(),
            counts_before=list(before.microbatches),
            counts_after=list(plan.microbatches),
            migrations=len(plan.migrations),
            predicted_before=result.current_s,
            predicted_after=result.predicted_s,
            predicted_before_s=result.current_s * scale if scale else None,
            predicted_after_s=result.predicted_s * scale if scale else None,
            plan_s=result.planning_s,
            restore=restore,
            explain=result.explain(),
        )
        moved = ""
        if restore == "reshard":
            stages = [[list(g.layers) for g in rep.stages] for rep in plan.replicas]
            moved = f"layers per stage {stages} (state moved between the ranks), "
        self.say(
            f"re-plan ({trigger['kind']}, rank {trigger['rank']} {trigger['factor']:.2f}x): "
            f"{moved}micro-batches per "
            f"replica {list(before.microbatches)} -> {list(plan.microbatches)}, "
            f"{len(plan.migrations)} stage migration(s); predicted iteration "
            f"{result.predicted_s / self.healthy_s:.2f}x the fault-free one, was "
            f"{result.current_s / self.healthy_s:.2f}x (planned in {result.planning_s * 1e3:.0f} ms)"
        )

    def _exclude(self, rank: int, kept: PlanResult, trigger: dict, iteration: int) -> bool:
        """Take slow `rank`'s device out of the world when that is predicted `adapt.min_gain`
        faster than `kept` (the best plan that keeps it: emptied of micro-batches, the device
        still steps its stage F x slower and its stage's reduction waits for it, [Note: step
        lead] in `unbroken.plan.score`). Its replica is dissolved as for a lost device
        (`_dissolve`): the survivors keep their layers and restore in place at the next
        generation (`restarts`, `next_world`), no checkpoint; the replica's other devices
        stand by. Re-admitted on trial `adapt.readmit_after` iterations later, doubling at
        each exclusion ([Note: slow device excluded] in `unbroken.launch.coordinator.adapt`).
        Returns whether it did."""
        if not self.excludes or self.plan.dp < 2:
            return False
        device = self.devices[rank]
        dissolved = self._dissolve([device])
        if dissolved is None:  # pragma: no cover - dp >= 2 leaves a whole replica
            return False
        plan = dissolved[0]
        without = plan_for_state(
            cluster(plan, self.state.workload), _planner(_LIVE, self.adapt)
        ).current_s
        if without > kept.predicted_s * (1.0 - self.adapt.min_gain):
            return False
        self.replans += 1
        self.excluded.exclude(
            device,
            trigger,
            iteration,
            (kept.predicted_s, without),
            self.healthy_s,
            "its replica dissolved",
        )
        return True

    def _swap(self, rank: int, kept: PlanResult, trigger: dict, iteration: int) -> bool:
        """A one-replica pipeline's slow device replaced by a standby (alive, outside the
        world: its replica was dissolved around a lost or excluded device), when the running
        plan at full speed is predicted `adapt.min_gain` faster than `kept` (the best plan
        with the device, layers moved or not): at a planned stop, the next generation runs
        the same plan on the standby instead, from the newest checkpoint — the standby holds
        none of the stage's current state, and no other replica does (`next_world`). The
        device is excluded like `_exclude`'s. Returns whether it did."""
        if not self.excludes or self.plan.dp != 1 or not self._standbys():
            return False
        healthy = plan_for_state(cluster(self.plan, self.state.workload)).current_s
        if healthy > kept.predicted_s * (1.0 - self.adapt.min_gain):
            return False
        how = f"standby device {self._standbys()[0]} takes its stage from the newest checkpoint"
        self.replans += 1
        self.excluded.exclude(
            self.devices[rank], trigger, iteration, (kept.predicted_s, healthy), self.healthy_s, how
        )
        return True

    def _standbys(self) -> list[int]:
        """Launch devices alive and outside the running world, neither lost nor excluded."""
        return [
            d
            for d in self.launch_devices
            if d not in self.devices and d not in self.lost and d not in self.excluded
        ]

    def readmit_due(self, iteration: int) -> bool:
        """After `iteration`: re-admit, on trial, excluded devices whose wait is over, while
        `adapt.max_replans` leaves room to exclude one again: the launch plan on the launch
        devices (`_grow`), the returned device and its replica's standbys filled from the
        other replica (`RankAction.FILL`). Returns whether one was (the caller stops the
        running generation: `restarts`)."""
        if self.replans >= self.adapt.max_replans:
            return False
        if self._moving is None and self._readmit_benched(iteration):
            return True
        due = self.excluded.readmit(self.devices, iteration, self.returned)
        if not due:
            return False
        self._trial = due
        return True

    def _readmit_benched(self, iteration: int) -> bool:
        """Devices a TP exclusion benched whose wait is over: marked healthy, and the launch
        plan (every device at full speed) is decided like a move back — a planned stop, the
        state moved to the launch layout, the device's rank a fresh holder filled from the
        others (`RestoreMode.RESHARD`), its fail-slow warm-up short (`NewWorld.trial`). A
        device still slow is reported and benched again, its wait doubled. When the launch
        plan is not predicted faster (another device slow since, say) the trial waits: the
        devices stay benched, marked slow, for their next wait. Returns whether it decided
        that."""
        held = dict(self.benched)
        due = self.benched.readmit(self.devices, iteration, None)
        if not due:
            return False
        state = self.state
        for d in due:
            self.state = self.state.with_healthy(self.devices.index(d))
        rank = self.devices.index(due[0])
        trigger = {"kind": "readmit_trial", "rank": rank, "device": due[0], "factor": 1.0}
        again = self._launch_again(self._best_plan()[0].current_s)
        if again is None:
            self.state = state
            why = "the launch plan is not predicted faster"
            for d in due:
                self.benched.postpone(d, held[d], iteration, why)
            return self._skip(trigger, f"{why}: the trial waits")
        self._decide_move(again, trigger, None, count=False)
        self._trial = due
        return True

    def on_recovered(self, rank: int, factor: float, iter_s: float | None = None) -> bool:
        """Rank `rank`, planned around as slow, runs at `factor` x the pace of its stages'
        holders in the other replicas again (`PlanFit.pace`): it is healthy in the cluster
        state and the scheduler's live plan for that state (micro-batches back to its replica:
        the launch counts when every device is healthy) is published like a fail-slow re-plan.
        A one-replica pipeline's rank (`factor`: its compute per layer over its healthy one,
        `LayerPace`), or any rank of a job whose layers moved, gets the layers back the way
        they left (`_layers_back`). Counted against
        `adapt.max_replans` (a moderate slowdown can look recovered on a machine whose ranks
        share cores; the job must not switch back and forth for ever). Returns whether it
        re-planned."""
        trigger: dict[str, Any] = {"kind": "speed_recovered", "rank": rank, "factor": factor}
        if not 0 <= rank < len(self.devices):
            return self._skip(trigger, "the report names no rank of the running world")
        trigger["device"] = self.devices[rank]
        if self.state.device(rank).status is not DeviceStatus.SLOW:
            return self._skip(trigger, f"rank {rank} is not marked slow")
        if self._moving is not None:
            return self._skip(trigger, "a re-plan that moves layers is waiting for its stop")
        if self.replans >= self.adapt.max_replans:
            return self._skip(trigger, f"adapt.max_replans = {self.adapt.max_replans} reached")
        self.state = self.state.with_healthy(rank)
        if self.plan.dp == 1 or not keeps_stages(
            self.launch, self.launch_devices, self.plan, self.devices
        ):
            return self._layers_back(trigger, iter_s)
        result = plan_for_state(self.state, _planner(_LIVE, self.adapt))
        plan = result.plan()
        if result.kept_current or plan.microbatches == self.plan.microbatches:
            return self._skip(trigger, "the plan for the healthy device is the running one")
        if not keeps_stages(self.plan, self.devices, plan, self.devices):
            return self._skip(trigger, "the scheduler's plan moves layers: not built live")
        self._adopt_live(result, plan, trigger, iter_s)
        return True

    def _layers_back(self, trigger: dict, iter_s: float | None) -> bool:
        """A one-replica pipeline's device at full speed again (marked healthy): the
        scheduler's plan with layer repartition for that state (`_best_plan`, `_MOVE`: the
        launch split when every device is healthy) is adopted like a fail-slow move — at a
        planned stop, the next generation moving the state between the ranks' retained
        buffers (`RestoreMode.RESHARD`), no checkpoint — when it moves layers and is
        predicted `adapt.min_gain` faster than the running plan. The scheduler repartitions
        around slow devices only, so a DP x PP job whose slow replica's layers moved alone
        finds no move once every device is healthy: there the launch plan is the candidate
        (`_launch_again`)."""
        result, moves = self._best_plan()
        if not moves:
            again = self._launch_again(result.current_s)
            if again is None:
                return self._skip(
                    trigger, "the plan for the healthy device keeps the running layers"
                )
            result = again
        self._decide_move(result, trigger, iter_s)
        return True

    def _launch_again(self, running_s: float) -> PlanResult | None:
        """The launch plan, priced for the current state, as a move from the running plan
        (predicted `running_s`): when every launch device runs it at full speed and it is
        predicted `adapt.min_gain` faster. None otherwise."""
        if self.devices != self.launch_devices or self.state.slowdown():
            return None
        if keeps_stages(self.launch, self.launch_devices, self.plan, self.devices):
            return None
        launch = plan_for_state(
            cluster(self.launch, self.state.workload), _planner(_LIVE, self.adapt)
        )
        if not launch.kept_current or launch.current_s >= running_s * (1.0 - self.adapt.min_gain):
            return None
        return replace(launch, current_s=running_s)

    def spec_fields(self) -> dict[str, Any]:
        """The generation spec's fields of the running plan."""
        return {"plan": self.plan.to_dict() if self.epoch else None, "plan_epoch": self.epoch}

    # -- decisions --------------------------------------------------------------------------
    def next_world(self, iter_s: float | None = None) -> NewWorld | None:
        """At a generation start: the survivors' devices under a smaller plan when the running
        world lost some (None: unchanged). Sets `relayout`.

        Raises:
            NoPlanError: no device is left.
        """
        self.replay_next = False
        gone = [d for d in self.devices if d in self.lost]
        out = [d for d in self.devices if d in self.excluded and d not in self.lost]
        if not gone and not out and self._moving is not None:
            return self._move_layers()
        self._moving = None  # a lost device is planned around from scratch
        if not gone and not out:
            return self._grow() if self.grows else None
        t0 = time.perf_counter()
        survivors = tuple(d for d in self.devices if d not in self.lost)
        if not survivors:
            raise NoPlanError("every device of the pipeline is lost")
        before, devices_before = self.plan, self.devices
        # A restart from the checkpoint may use the standbys too (devices of a replica
        # dissolved before, alive and outside the running world): its state is read anew.
        standbys = [d for d in self.launch_devices if d not in self.devices]
        alive = tuple(sorted(survivors + tuple(d for d in standbys if d not in self.lost)))
        if out and not gone and self.plan.dp == 1:
            return self._swap_world(out, t0, iter_s)
        # Evict-and-restart (Oobleck-like): a fresh even plan from the checkpoint, lost or not.
        evicting = self.evicts or any(d in self.evicted for d in gone)
        dissolved = None if evicting else self._dissolve(sorted(gone + out))
        if dissolved is not None and gone and not out and self._regroup(gone, t0):
            return NewWorld(self.devices, None, self.epoch)
        if dissolved is None and out:
            self._keep(out)
            if not gone:
                return None
            dissolved = self._dissolve(gone)
        plan, devices, explain = dissolved or self._shrink(alive)
        if gone:
            trigger, predicted = self._lost_trigger(gone), None
        else:  # a slow device leaves the world ([Note: slow device excluded])
            x = self.excluded[out[0]]
            trigger, predicted = x.trigger, (x.predicted_with, x.predicted_without)
        # A shrunk plan starts from the checkpoint even where a survivor kept its layers: the
        # lost stage's state exists nowhere else, and every rank must start at one iteration.
        self._adopt_world(
            plan,
            devices,
            trigger,
            explain,
            t0,
            checkpoint=dissolved is None,
            predicted=predicted,
            iter_s=iter_s,
        )
        what = f"device lost {gone}" if gone else f"slow device {out} out"
        self._say_world(what, before, devices_before)
        return NewWorld(self.devices, None, self.epoch)

    def _say_world(self, what: str, before: ParallelPlan, devices_before: tuple[int, ...]) -> None:
        stages = [list(g.layers) for g in self.plan.replicas[0].stages]
        source = "from the newest checkpoint" if self.relayout else "in place, no checkpoint"
        self.say(
            f"re-plan ({what}): devices {list(devices_before)} -> "
            f"{list(self.devices)}, {before.dp} x {before.pp} -> {self.plan.dp} x {self.plan.pp} "
            f"(replicas x stages) stages {stages}, {source}"
        )

    def _lost_trigger(self, gone: list[int]) -> dict[str, Any]:
        return {"kind": "device_lost", "devices": gone, "reason": self.lost[gone[0]]}

    def _regroup(self, gone: list[int], t0: float) -> bool:
        """The lost devices' TP groups shrunk to their devices left instead of their replicas
        dissolved (`regroup_lost`: the job retains its state and the shrunk plan keeps the
        launch bits and is predicted `adapt.min_gain` faster): the next generation moves the
        state to it from the whole replicas (`RestoreMode.RESHARD`), no checkpoint. Returns
        whether it did."""
        if not self.moves_layers:
            return False
        found = regroup_lost(
            self.plan,
            self.devices,
            gone,
            self.launch,
            self.state.workload,
            config=_planner(_SHRINK, self.adapt),
            min_gain=self.adapt.min_gain,
            bits_tp=self.bits_tp,
        )
        if found is None:
            return False
        before = self.devices
        self._adopt_world(
            found.plan,
            found.devices,
            self._lost_trigger(gone),
            found.explain,
            t0,
            predicted=(None, found.predicted_s),
            held=found.before,
        )
        groups = [(list(g.ranks), g.tp) for rep in found.plan.replicas for g in rep.stages]
        self.say(
            f"re-plan (device lost {gone}): devices {list(before)} -> {list(self.devices)}, "
            f"TP groups (ranks, degree) {groups}, micro-batches "
            f"{list(found.plan.microbatches)}; the state moves from the whole replicas, no "
            "checkpoint"
        )
        return True

    def _swap_world(self, out: list[int], t0: float, iter_s: float | None) -> NewWorld | None:
        """The running one-replica plan on the standbys instead of the excluded devices
        (`_swap`), from the newest checkpoint: the ranks in device order, each loading its
        stage. None (the devices stay) when too few standbys are left."""
        standbys = self._standbys()
        if len(standbys) < len(out):
            self._keep(out)
            return None
        before = self.devices
        devices = tuple(sorted([d for d in before if d not in out] + standbys[: len(out)]))
        x = self.excluded[out[0]]
        explain = (
            f"devices {out} replaced by standbys {standbys[: len(out)]}: the same plan, every "
            "stage loaded from the newest checkpoint (no other replica holds the stages)"
        )
        self._adopt_world(
            self.plan,
            devices,
            x.trigger,
            explain,
            t0,
            checkpoint=True,
            predicted=(x.predicted_with, x.predicted_without),
            iter_s=iter_s,
        )
        self.say(
            f"re-plan (slow device {out} out): devices {list(before)} -> {list(devices)}, "
            "the same stages, from the newest checkpoint"
        )
        return NewWorld(self.devices, None, self.epoch)

    def _keep(self, out: list[int]) -> None:
        """Excluded devices the plan cannot do without after all (a device lost since left no
        replica whole without them): they stay in the world, their exclusion dropped."""
        for d in out:
            x = self.excluded.pop(d)
            self._skip(x.trigger, f"device {d} stays: no replica is left whole without it any more")

    def _move_layers(self) -> NewWorld:
        """The decided re-plan that moves layers, on the same devices: the next generation
        moves the ranks' retained state to its layout (`reshard`: the plan it holds now)."""
        assert self._moving is not None
        result, plan, trigger, iter_s = self._moving
        self._moving = None
        self.reshard = self.plan
        self._adopt_live(result, plan, trigger, iter_s, restore="reshard")
        trial, self._trial = self._trial, ()
        return NewWorld(self.devices, None, self.epoch, trial)

    def _adopt_world(
        self,
        plan: ParallelPlan,
        devices: tuple[int, ...],
        trigger: dict,
        explain: str,
        t0: float,
        *,
        checkpoint: bool = False,
        predicted: tuple[float | None, float | None] | None = None,
        iter_s: float | None = None,
        held: ParallelPlan | None = None,
    ) -> None:
        """Make `plan` on `devices` the next generation's world (ranks renumbered: the slow
        marks start over; the measured costs, `calibrate`, stay), decide whether it restores
        in place (`relayout`), log `replan` (`predicted`: the scheduler's iteration before and
        after, its units, when it priced the change: a slow device's exclusion). `held`: the
        plan, in the new world's ranks, that the devices' retained state holds when the next
        generation moves it to `plan` itself (`reshard`, `RestoreMode.RESHARD`)."""
        before, devices_before = self.plan, self.devices
        self.plan, self.devices = plan, devices
        self.relayout = checkpoint or not keeps_stages(before, devices_before, plan, devices)
        if held is not None:
            self.relayout, self.reshard = False, held
        self.epoch += 1
        self.state = cluster(plan, self.state.workload)
        was, now = predicted or (None, None)
        scale = iter_s / self.healthy_s if iter_s and predicted else None
        self.events.emit(
            "replan",
            epoch=self.epoch,
            trigger=trigger,
            devices_before=list(devices_before),
            devices_after=list(devices),
            before=before.stage_records(),
            after=plan.stage_records(),
            counts_before=list(before.microbatches),
            counts_after=list(plan.microbatches),
            predicted_before=was,
            predicted_after=now,
            predicted_before_s=was * scale if scale and was is not None else None,
            predicted_after_s=now * scale if scale and now is not None else None,
            plan_s=time.perf_counter() - t0,
            restore="checkpoint" if self.relayout else "reshard" if held else "in_place",
            replayed=self.replay_next,
            explain=explain,
        )

    def _grow(self) -> NewWorld:
        """The launch plan on the launch devices again (every device back). The devices that
        kept their stage restore in place, the returned ones take their replica's state
        (`RankAction.FILL`). When the running plan moved a survivor's layers (a shorter
        pipeline, a shrunk TP group), the job retaining its state moves it to the launch
        layout (`RestoreMode.RESHARD`: the running plan in the launch world's ranks is the one
        held, the returned devices ranks of no stage); without retained state the launch plan
        loads from the newest checkpoint."""
        t0 = time.perf_counter()
        back = sorted(self.returned)
        reason = self.returned[back[0]]
        self.returned.clear()
        devices_before = self.devices
        held = None
        # Back from bits of a smaller TP degree: from the checkpoint, which the reference
        # replays the change from ([Note: replayed plan change]).
        self.replay_next = self.bits_tp != self.launch_tp
        self.bits_tp = self.launch_tp
        if (
            self.moves_layers
            and not self.replay_next
            and not keeps_stages(self.plan, self.devices, self.launch, self.launch_devices)
        ):
            # The survivors' state moves to the launch layout (the returned devices, ranks of
            # no stage in the plan they held, receive theirs), as a move of layers does.
            where = {r: self.launch_devices.index(d) for r, d in enumerate(self.devices)}
            held = relabeled(self.plan, where)
        self._adopt_world(
            self.launch,
            self.launch_devices,
            {"kind": "devices_returned", "devices": back, "reason": reason},
            "every device the job launched with is back: the launch plan"
            + (" (its bits again, from the newest checkpoint)" if self.replay_next else ""),
            t0,
            held=held,
            checkpoint=self.replay_next,
        )
        how = "in place (replicas fill)"
        if held is not None:
            how = "the state moved to its layout between the ranks, no checkpoint"
        elif self.relayout:
            how = "from the newest checkpoint"
        self.say(
            f"re-plan (devices returned {back}): devices {list(devices_before)} -> "
            f"{list(self.devices)}, the launch plan again, {how}"
        )
        trial, self._trial = self._trial, ()
        return NewWorld(self.devices, None, self.epoch, trial)

    def _shrink(self, survivors: tuple[int, ...]) -> tuple[ParallelPlan, tuple[int, ...], str]:
        """No replica left whole: one even pipeline on the survivors, from the newest
        checkpoint (its layout differs from every survivor's state); the survivors it leaves
        out are standbys.

        Its TP degree is the one whose bits the job computes (`bits_tp`) while enough
        survivors are left. A TP-2 job with a single survivor runs at TP 1, its stages
        computing as TP 2 (bit for bit, `unbroken.engine.emulate`). With fewer survivors than
        a larger degree the pipeline runs at the largest power of two they hold: the job's
        bits change (a smaller group sums in another order), and the fault-free reference
        replays the change from the same checkpoint ([Note: replayed plan change]).

        Raises:
            NoPlanError: stages of different TP degrees with no launch plan to fall back on.
        """
        before, launch_tp = self.plan, self.launch_tp
        if len({g.tp for rep in before.replicas for g in rep.stages}) > 1:
            before = self.launch  # a TP group shrunk before: plan from the launch degree
        n, bits = len(survivors), self.bits_tp
        tp = bits if n >= bits else 1 if bits == launch_tp == 2 else 1 << (n.bit_length() - 1)
        try:
            plan = shrink_pipeline(before, n, tp)
        except ValueError as exc:
            raise NoPlanError(f"no replica is left whole, and {exc}") from None
        self.replay_next = not emulates(self.launch, plan, n, bits)
        degree = f" at TP {tp}" if tp > 1 else ""
        if tp < launch_tp and not self.replay_next:
            degree = f" at TP 1, computing as TP {launch_tp} (the launch plan's bits)"
        elif self.replay_next:
            self.bits_tp = tp
            degree = (
                f" at TP {tp}: fewer survivors than the TP degree {bits}, so the job's bits "
                f"change (a TP-{tp} stage sums in another order) and the fault-free reference "
                "replays this change from the same checkpoint"
            )
        explain = (
            f"the lost device held the only copy of its stage, so the scheduler keeps no "
            f"pipeline of depth {before.pp}; the survivors run an even pipeline of depth "
            f"{plan.pp}{degree} from the newest checkpoint loaded under it"
        )
        return plan, survivors[: len(plan.ranks)], explain

    def _dissolve(self, gone: list[int]) -> tuple[ParallelPlan, tuple[int, ...], str] | None:
        """A plan around the lost devices on which every survivor keeps its stage, its ranks
        renumbered 0..n-1 in device order, with the devices it runs on and its explanation:
        the scheduler's when it is one (a dissolved replica), else the broken replicas
        dissolved (`dissolve_replicas`: the scheduler would shrink a TP group, whose shards
        then need resharding). None when no replica is left whole."""
        plan = self.plan
        lost_ranks = [r for r, d in enumerate(self.devices) if d in gone and r in plan.ranks]
        if not lost_ranks:  # benched devices (TP exclusion): the plan runs on as it is
            chosen, notes = plan, ["the lost device(s) held no stage (a standby in the world)"]
        elif plan.dp == 1:
            return None
        else:
            try:
                result = plan_for_state(cluster(plan).with_lost(*lost_ranks))
                chosen = result.layout.skeleton
                notes = [n for step in result.steps for n in step.notes]
            except NoPlanError:
                chosen, notes = None, []
        if lost_ranks and (
            chosen is None
            or not (same_layouts(chosen) and keeps_stages(plan, self.devices, chosen, self.devices))
        ):
            try:
                chosen = dissolve_replicas(plan, lost_ranks)
            except NoPlanError:
                return None
            notes = [
                "the scheduler's plan changes what a survivor holds; instead every replica "
                "with a lost device is dissolved and the others own its micro-batches"
            ]
        used = sorted(chosen.ranks)
        new = renumbered(chosen, used)
        devices = tuple(self.devices[r] for r in used)
        standbys = [d for r, d in enumerate(self.devices) if r not in used and d not in gone]
        explain = (
            "; ".join(notes) or "the scheduler's plan around the lost device"
        ) + f"; standbys (alive, outside the world): devices {standbys}"
        return new, devices, explain

    def _skip(self, trigger: dict, reason: str) -> bool:
        self.events.emit("replan_skipped", trigger=trigger, reason=reason)
        self.say(f"no re-plan for {trigger['kind']}: {reason}")
        return False
