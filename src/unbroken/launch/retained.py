"""A trainer's retained state in in-place mode: regions from the rank's state manager, the
resumable updater over them, and the recovery protocol after a hardware-operable failure.

Order after a failure (a replacement trainer, generation > 0):
  1. attach the regions by name — mapping touches no page;
  2. localize failed pages through the state manager (memfd holes / poisoned pages) and remap
     them, before anything reads retained memory ([Note: localize before touching]);
  3. `ResumableUpdater.repair`: marker, interrupted chunk (undo or roll-forward), lost pages
     from parity, second tier first;
  4. agree with every other rank (one all_gather of the markers) on where the job stands: if any
     rank passed the global synchronization of iteration t, every rank finishes t's update from
     its last committed chunk with the recorded statistics; otherwise iteration t is redone;
  5. continue at the agreed iteration.
A rank that cannot repair (beyond parity tolerance, lost undo buffer …) makes every rank exit
with `FATAL_EXIT`, and the coordinator falls back to checkpoint-restart.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from unbroken.config import JobConfig
from unbroken.model.flat import FlatLayout
from unbroken.state.client import RetainedClient, RetainedRegion
from unbroken.state.pageloss import punch_pages
from unbroken.train.state import TrainState
from unbroken.update.geometry import StateGeometry
from unbroken.update.layout import RetainedLayout
from unbroken.update.marker import Stage
from unbroken.update.rmu import RepairReport, ResumableUpdater, state_from_regions

__all__ = ["InconsistentState", "RetainedState", "agree_and_resume"]


class InconsistentState(Exception):
    """Ranks' retained progress cannot be brought to one iteration boundary."""


@dataclass(slots=True)
class RetainedState:
    """Regions of one rank, mapped; filled in by `allocate` during `build_training`."""

    cfg: JobConfig
    client: RetainedClient
    regions: dict[str, RetainedRegion] | None = None
    fresh: bool = True
    localize_ms: float = 0.0
    remap_ms: float = 0.0
    lost: dict[str, list[int]] | None = None

    def allocate(
        self, layout: FlatLayout, geometry: StateGeometry, device: torch.device
    ) -> tuple[TrainState, bool]:
        """The `allocate` callback of `build_training`: map every region; if they are
        retained, localize and remap failed pages before anything touches them.

        On a CUDA device every region but the marker is GPU memory owned by the state manager
        (`unbroken.state.cuda_vmm`): the model state, gradients, both parity tiers and the
        updater's buffers live on the device, where the codec runs; the marker, written after
        every operation and read first on recovery, stays in host memory."""
        specs = RetainedLayout.of(geometry, self.cfg.protection).regions()
        self.regions = {
            s.name: self.client.allocate(
                s.name, s.nbytes, **_placement(s, device, geometry.page_bytes)
            )
            for s in specs
        }
        self.fresh = self.regions["model"].fresh
        if self.fresh:
            for region in self.regions.values():
                region.tensor.zero_()  # write every page: an untouched page is a hole
        else:
            report = self.client.localize()
            self.localize_ms = report.ms
            self.lost = {k: v for k, v in report.lost.items() if v}
            for name, pages in self.lost.items():
                self.remap_ms += self.client.remap(name, pages)
        tensors = {name: r.tensor for name, r in self.regions.items()}
        return state_from_regions(layout, geometry, tensors), self.fresh

    def page_loss_target(self, geometry: StateGeometry):
        """The page-loss injector's target: destroys pages of one protection group for real
        (host: holes punched in the memfd; GPU: the pages' allocations released by the manager
        and by this trainer, so the driver frees them). Recovery never sees what it chose."""
        layout = RetainedLayout.of(geometry, self.cfg.protection)

        def punch(fault) -> dict[str, list[int]]:
            assert self.regions is not None
            rng = random.Random(fault.key)
            if fault.group is not None:
                chosen = [(fault.group + i) % layout.groups for i in range(fault.groups)]
            else:
                chosen = rng.sample(range(layout.groups), min(fault.groups, layout.groups))
            pages: dict[str, list[int]] = {"model": [], "model_parity": []}
            for g in chosen:
                data = layout.group_rows("model", g)
                pages["model"] += rng.sample(data, min(fault.pages, len(data)))
                first_tier = layout.parity_rows(g, 1)
                pages["model_parity"] += rng.sample(first_tier, min(fault.parity, len(first_tier)))
            pages = {k: sorted(v) for k, v in pages.items() if v}
            for name, idx in pages.items():
                region = self.regions[name]
                if region.device is None:
                    punch_pages(region, idx)
                else:  # both references dropped: the driver frees the pages' memory
                    self.client.discard(name, idx)
                    region.unmap_pages(idx)
            return pages

        return punch

    def tensors(self) -> dict[str, torch.Tensor]:
        assert self.regions is not None
        return {name: r.tensor for name, r in self.regions.items()}


def _placement(spec, device: torch.device, page_bytes: int) -> dict[str, Any]:
    """allocate() keywords for one region: host memory on CPU and for the marker; else GPU
    memory, whose unprotected buffers take the protected pages' size (a multiple of the
    allocation granularity, which the manager checks)."""
    if device.type == "cpu" or spec.name == "marker":
        return {"page_bytes": spec.page_bytes, "protected": spec.protected}
    page = spec.page_bytes if spec.protected else page_bytes
    return {"page_bytes": page, "protected": spec.protected, "device": device.index or 0}


def _marker_row(upd: ResumableUpdater, ok: bool) -> list[float]:
    st = upd.marker.state if ok else None
    if st is None:
        return [0.0] * 8
    return [
        1.0,
        float(st.stage),
        float(st.iteration),
        float(st.done_iter),
        st.loss,
        st.grad_norm,
        st.grad_scale,
        st.lr,
    ]


def agree_and_resume(
    upd: ResumableUpdater,
    report: RepairReport | None,
    group: dist.ProcessGroup | None,
    hook,
) -> tuple[int, dict[str, Any]]:
    """Steps 4-5 of the module docstring. Returns (next iteration, decision record).

    Raises:
        InconsistentState: some rank could not repair, or ranks disagree beyond repair.
    """
    t0 = time.perf_counter()
    row = torch.tensor(_marker_row(upd, report is not None), dtype=torch.float64)
    world = dist.get_world_size(group) if group is not None else 1
    if group is not None:
        from unbroken.launch.restore import collective_device

        row = row.to(collective_device(group))
        rows = [torch.zeros_like(row) for _ in range(world)]
        dist.all_gather(rows, row, group=group)
    else:
        rows = [row]
    table = torch.stack(rows).cpu()
    if bool((table[:, 0] == 0).any()):
        bad = [i for i in range(world) if table[i, 0] == 0]
        raise InconsistentState(f"rank(s) {bad} could not repair their retained state")
    stages = table[:, 1].long().tolist()
    iters = table[:, 2].long().tolist()
    done = table[:, 3].long().tolist()
    synced = [i for i in range(world) if stages[i] == Stage.SYNCED]
    st = upd.marker.state
    decision: dict[str, Any] = {"stages": stages, "done": done}
    if synced:
        t = iters[synced[0]]
        if any(iters[i] != t for i in synced):
            raise InconsistentState(f"ranks synced different iterations: {iters}")
        src = table[synced[0]]
        loss, norm, scale, lr = (float(x) for x in src[4:8])
        if st.stage is Stage.SYNCED and st.iteration == t:
            decision["action"] = f"finish update of {t} from chunk g{st.group}/c{st.chunk}"
        elif st.stage is Stage.GRADS_PROTECTED and st.iteration == t:
            upd.record_sync(t, loss=loss, grad_norm=norm, grad_scale=scale, lr=lr)
            decision["action"] = f"finish update of {t} from the start (statistics of a peer)"
        elif st.stage is Stage.IDLE and st.done_iter == t:
            decision["action"] = f"update of {t} already complete"
        else:
            raise InconsistentState(f"rank marker {st} cannot join the update of {t}")
        if upd.marker.state.stage is Stage.SYNCED:
            upd.update(t, lr=upd.marker.state.lr, grad_scale=upd.marker.state.grad_scale, hook=hook)
        nxt = t + 1
    else:
        if len(set(done)) != 1:
            raise InconsistentState(f"ranks completed different iterations: {done}")
        nxt = done[0] + 1
        decision["action"] = f"redo iteration {nxt}" if max(stages) else "resume at boundary"
    decision["agree_ms"] = (time.perf_counter() - t0) * 1e3
    return nxt, decision
