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
Steps 1-3 are here (`allocate`, `repair_locally`); steps 4-5 are the one recovery decision
(`unbroken.recovery.decide_restore`), executed by `unbroken.launch.restore`. A rank that cannot
repair (beyond parity tolerance, lost undo buffer …) makes every rank exit with
`RankExit.FALLBACK`, and the coordinator falls back to checkpoint-restart.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Any

import torch

from unbroken.config import JobConfig
from unbroken.erasure import UnrecoverableError
from unbroken.model.flat import FlatLayout
from unbroken.recovery import RetainedSummary
from unbroken.state.client import RetainedClient, RetainedRegion
from unbroken.state.pageloss import punch_pages
from unbroken.train.state import TrainState
from unbroken.update.geometry import StateGeometry
from unbroken.update.layout import RetainedLayout
from unbroken.update.rmu import (
    NothingRetained,
    RepairReport,
    ResumableUpdater,
    state_from_regions,
)

__all__ = ["RetainedState"]


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
    nothing: str = ""
    """Why this rank retained nothing ("" when it retained something; see `repair_locally`)."""
    relayout: bool = False
    """The trainer does not resume from these regions (a checkpoint restart): a region whose
    geometry differs from this layout's — the device ran another plan before — is freed and
    made again, instead of refused."""
    map_s: float = 0.0
    """Seconds `allocate` took: mapping the regions (or finding them premapped), localizing
    and remapping lost pages."""
    premapped: int = 0
    """Regions `allocate` found already mapped by this client (a promoted shadow's premapping)."""

    def allocate(
        self, layout: FlatLayout, geometry: StateGeometry, device: torch.device
    ) -> tuple[TrainState, bool]:
        """The `allocate` callback of `build_training`: map every region; if they are
        retained, localize and remap failed pages before anything touches them.

        On a CUDA device the model state, gradients, gradient parity and the updater's buffers
        are GPU memory owned by the state manager (`unbroken.state.cuda_vmm`); the marker,
        written after every operation and read first on recovery, and the model's parity
        (`RetainedLayout.host_regions`) stay in host memory, which the updater registers with
        CUDA."""
        t0 = time.perf_counter()
        before = self.client.mapped()
        specs = RetainedLayout.of(geometry, self.cfg.protection).regions()
        # A rank of no stage holds nothing to resume, whatever its regions were made for (a
        # lost device's TP peer joining a shrunk group from a plan where it held no stage):
        # they take this geometry ([Note: a rank of no stage] in `unbroken.recovery.decision`).
        replace = self.relayout or layout.numel == 0
        self.regions = {
            s.name: self.client.allocate(
                s.name,
                s.nbytes,
                replace=replace,
                **_placement(s, device, geometry.page_bytes, self.cfg.protection),
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
        self.premapped = sum(before.get(n) is r for n, r in self.regions.items())
        self.map_s = time.perf_counter() - t0
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

    def repair_locally(
        self, updater: ResumableUpdater, rank: int, events
    ) -> tuple[RetainedSummary, RepairReport | None]:
        """Step 3: repair this rank's retained state (no collective), or find it holds nothing;
        returns its summary for the decision and the repair's report (None: not repaired)."""
        if self.fresh:
            self.nothing = "this rank's retained state is gone (its regions are new)"
        elif self.regions is not None and self.regions["marker"].fresh:
            self.nothing = "this rank's marker region is new"  # died allocating the regions
        if self.nothing:
            return RetainedSummary(held=False, repaired=False, progress=False), None
        try:
            report = updater.repair(self.lost or {})
        except NothingRetained as exc:
            self.nothing = f"this rank retained nothing: {exc}"
            return RetainedSummary(held=False, repaired=False, progress=False), None
        except UnrecoverableError as exc:
            events.emit("inplace_unrecoverable", rank=rank, reason=str(exc))
            return RetainedSummary(held=True, repaired=False, progress=True), None
        marker = updater.marker.state
        summary = RetainedSummary(
            held=True, repaired=True, progress=marker.done_iter >= 0, marker=marker
        )
        return summary, report

    def tensors(self) -> dict[str, torch.Tensor]:
        assert self.regions is not None
        return {name: r.tensor for name, r in self.regions.items()}


def _placement(spec, device: torch.device, page_bytes: int, prot) -> dict[str, Any]:
    """allocate() keywords for one region: host memory on CPU, for the marker, and for the
    model's parity unless `protection.parity_memory` is "device"; else GPU memory, whose
    unprotected buffers take the protected pages' size (a multiple of the allocation
    granularity, which the manager checks)."""
    if device.type == "cpu" or spec.name in RetainedLayout.host_regions(prot):
        return {"page_bytes": spec.page_bytes, "protected": spec.protected}
    page = spec.page_bytes if spec.protected else page_bytes
    return {"page_bytes": page, "protected": spec.protected, "device": device.index or 0}
