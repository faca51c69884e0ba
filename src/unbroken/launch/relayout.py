"""A generation that moves the job's state to another plan's layout (`RestoreMode.RESHARD`,
issue 18 item 3, ResiHP Figure 8): layers moved between the stages of a running pipeline job,
with no checkpoint.

The coordinator decided a plan that moves layers (a slow device) and stopped the running
generation at a planned stop. The next generation's trainers, on the same devices:

  1. attach their state managers' regions of the plan before (`GenerationSpec.plan_before`)
     and restore them in place exactly as after a failure (`unbroken.launch.restore`): repair,
     agree on one boundary, finish an interrupted update — the stop may have come mid-update;
  2. copy their parameters and optimizer moments out of retained memory, by name;
  3. give their regions the new plan's geometry (freed and made again where it differs) and
     build the new plan's executor on them;
  4. move every parameter and both moments to the ranks that hold it under the new plan
     (`unbroken.engine.reshard`: one batched point-to-point exchange; a rank's own pieces are
     copied locally);
  5. write parity and the marker of the moved state (`ResumableUpdater.initialize`), then
     meet at a barrier: from here the state is the new plan's and is recovered in place.

A failure in steps 1-5 leaves the ranks' regions in two layouts; the coordinator sees the
generation fail before it completed an iteration and restarts from the newest checkpoint
under the new plan (`CoordinatorCore._restore_for`), so a second failure during the
reconfiguration is recovered. At TP 1 and with the ordered reduction the moved layers compute
the same bits on any stage, so the job stays bit-exact against the fault-free run on the
launch plan.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from unbroken.model import resolve_args
from unbroken.train.phases import Phase

__all__ = ["SEGMENTS", "MoveTimes", "copy_out", "move_state"]

SEGMENTS = ("params", "exp_avg", "exp_avg_sq")
"""What moves with a layer: its parameters (fp32 masters) and both Adam moments."""


@dataclass(frozen=True, slots=True)
class MoveTimes:
    """Seconds of each step of `move_state` on this rank, and the bytes it received."""

    copy_s: float
    build_s: float
    transfer_s: float
    parity_s: float
    bytes_in: int

    def to_dict(self) -> dict[str, float | int]:
        return {s: getattr(self, s) for s in self.__slots__}


def _named(executor) -> dict[str, dict[str, torch.Tensor]]:
    state = executor.state
    return {seg: state.layout.views(getattr(state, seg)) for seg in SEGMENTS}


def copy_out(executor) -> dict[str, dict[str, torch.Tensor]]:
    """Step 2: this rank's parameters and moments by segment and name, copied out of retained
    memory (the new regions may take the same memory)."""
    with torch.no_grad():
        return {seg: {n: t.clone() for n, t in ts.items()} for seg, ts in _named(executor).items()}


def move_state(*, cfg, old_plan, new_plan, held, build_new, group, start: int, copy_s: float):
    """Steps 3-5 on this rank (collective over `group`, the generation's world): `held` is
    this rank's state under `old_plan` (`copy_out`) at the boundary before iteration `start`;
    `build_new()` builds the executor of `new_plan` on regions of its geometry. Returns the
    new executor and this rank's `MoveTimes`."""
    from unbroken.engine.reshard import reshard

    t1 = time.perf_counter()
    new = build_new()
    t2 = time.perf_counter()
    new.hook(Phase.MOVE, start, 0, 2)
    bytes_in = reshard(old_plan, new_plan, resolve_args(cfg.model), group, held, _named(new))
    t3 = time.perf_counter()
    new.hook(Phase.MOVE, start, 1, 2)
    new.updater.initialize(done_iter=start - 1)  # parity and marker of the moved state
    dist.barrier(group)
    t4 = time.perf_counter()
    return new, MoveTimes(copy_s, t2 - t1, t3 - t2, t4 - t3, bytes_in)
