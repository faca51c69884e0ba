"""The coordinator's re-planning of a pipeline job (issue 18): a lost stage, continued on the
devices left, from the newest checkpoint loaded under the smaller plan.

`Adaptation` (`adapt.py`) re-plans data-parallel jobs, whose survivors keep their retained
replicas. A pipeline job of one replica at TP 1 (`parallel.pp` > 1, `tp` = `dp` = 1) holds every
stage once: a lost device takes a stage's only copy of its state with it. The scheduler's steps
keep the pipeline depth and find no plan (`NoPlanError`); `shrink_pipeline` gives the survivors
an even pipeline of their own. The layout of every surviving rank changes with it, so the next
generation starts from the newest checkpoint, resharded to the new plan
(`unbroken.engine.ckpt_layout`, `RestoreMode.CHECKPOINT`); the survivors' state managers give
their regions the new geometry. The plan travels in the generation spec (`GenerationSpec.plan`).

What is not built here, and said so in the `replan_skipped` events: moving the survivors'
retained state to the new layout without a checkpoint (`engine.reshard` over the live job);
re-planning around a slow device; growing back when lost devices return (they are kept as
standbys). A TP > 1 or DP > 1 plan is refused by the config (`adapt.enabled`).

Pure decisions and the event log: no processes, no sockets.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from unbroken.detect.events import DetectionEvent
from unbroken.launch.coordinator.adapt import NewWorld
from unbroken.metrics.log import JsonlLog
from unbroken.parallel import ParallelPlan
from unbroken.plan import NoPlanError
from unbroken.plan.shrink import shrink_pipeline

__all__ = ["PipelineAdaptation"]


class PipelineAdaptation:
    """The `Adaptation` interface for a pipeline job. Args: plan (the launch plan, ranks =
    devices), events, say."""

    evicts = False
    grows = False
    """Lost devices that return are kept as standbys (growing a pipeline back: not built)."""

    def __init__(self, plan: ParallelPlan, events: JsonlLog, say: Callable[[str], None]) -> None:
        self.plan, self.events, self.say = plan, events, say
        self.devices: tuple[int, ...] = tuple(sorted(plan.ranks))
        """rank -> device, of the running world."""
        self.epoch = 0
        self.lost: dict[int, str] = {}
        self.relayout = False
        """The plan of the next generation differs from the one the survivors' state holds:
        they start from a checkpoint (read and cleared by the coordinator)."""

    # -- reports ----------------------------------------------------------------------------
    def note_lost(self, device: int, reason: str) -> None:
        self.lost.setdefault(device, reason)

    def note_returned(self, devices: list[int], reason: str) -> None:
        """Lost devices usable again. Back before the world shrank (a spare node took them at
        once), the running plan keeps them; once it shrank, they stay standbys."""
        back = [d for d in devices if self.lost.pop(d, None) is not None]
        outside = [d for d in back if d not in self.devices]
        if outside:
            self._skip(
                {"kind": "devices_returned", "devices": outside, "reason": reason},
                "growing a pipeline plan back is not built: the devices stay standbys",
            )

    def on_fail_slow(self, event: DetectionEvent, iter_s: float | None = None) -> bool:
        trigger = {"kind": "fail_slow", "rank": event.rank, "factor": event.factor}
        return self._skip(trigger, "re-planning a pipeline job around a slow device is not built")

    def on_recovered(self, rank: int, factor: float, iter_s: float | None = None) -> bool:
        return False  # nothing was re-planned for a slow device

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
        gone = [d for d in self.devices if d in self.lost]
        if not gone:
            return None
        t0 = time.perf_counter()
        survivors = tuple(d for d in self.devices if d not in self.lost)
        if not survivors:
            raise NoPlanError("every device of the pipeline is lost")
        before, devices_before = self.plan, self.devices
        self.plan = shrink_pipeline(before, len(survivors))
        used = len(self.plan.ranks)
        self.devices = survivors[:used]
        self.epoch += 1
        self.relayout = True
        trigger = {"kind": "device_lost", "devices": gone, "reason": self.lost[gone[0]]}
        explain = (
            f"the lost device held the only copy of its stage (one replica at TP 1), so the "
            f"scheduler keeps no pipeline of depth {before.pp}; the survivors run an even "
            f"pipeline of depth {self.plan.pp} from the newest checkpoint loaded under it"
        )
        self.events.emit(
            "replan",
            epoch=self.epoch,
            trigger=trigger,
            devices_before=list(devices_before),
            devices_after=list(self.devices),
            before=before.stage_records(),
            after=self.plan.stage_records(),
            counts_before=list(before.microbatches),
            counts_after=list(self.plan.microbatches),
            predicted_before=None,
            predicted_after=None,
            predicted_before_s=None,
            predicted_after_s=None,
            plan_s=time.perf_counter() - t0,
            restore="checkpoint",
            explain=explain,
        )
        stages = [list(g.layers) for g in self.plan.replicas[0].stages]
        self.say(
            f"re-plan (device lost {gone}): devices {list(devices_before)} -> "
            f"{list(self.devices)}, pipeline {before.pp} -> {self.plan.pp} stages {stages}, "
            "from the newest checkpoint"
        )
        return NewWorld(self.devices, None, self.epoch)

    def _skip(self, trigger: dict, reason: str) -> bool:
        self.events.emit("replan_skipped", trigger=trigger, reason=reason)
        self.say(f"no re-plan for {trigger['kind']}: {reason}")
        return False
