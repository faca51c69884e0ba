"""The Resumable Model Updater (Leto §5.2, Pseudocode 1): chunk-level transactions over
retained, erasure-protected state.

Per iteration: `protect` encodes the gradient groups (both tiers) before the global
synchronization; `record_sync` writes the agreed statistics into the marker; `update` runs every
chunk as a transaction (undo copy → in-place step → new parity range into scratch → write-back →
commit); the marker is written after every operation. After a crash, `repair` brings the state
back to a consistent boundary (undo restore or parity roll-forward, per the marker), rebuilds
lost pages from parity (second tier first), and `update` resumes from the last committed chunk.

State machine of one chunk (marker stage after each step; see `Stage`):

    SYNCED(g, j) --undo copied--> CHUNK_UPDATING(g, j) --stepped, parity in scratch-->
    PARITY_READY(g, j) --written back--> SYNCED(g, j+1)  (… IDLE(done_iter = t) after the last)

A rule of several passes (Muon; `unbroken.update.rule`) runs every chunk once per pass:
transaction k is chunk k mod n of pass k div n, and the marker's (group, chunk) count on across
passes, so resuming needs nothing more than today's position (the pass's derived buffer is
computed again from retained state on entry).

Recovery per stage: SYNCED / GRADS_PROTECTED / IDLE need nothing; CHUNK_UPDATING restores the
chunk from the undo buffer (its parity is still the committed one); PARITY_READY writes the
scratch parity back (the chunk's data is already new). Either way data and parity then agree.

[Note: write-back behind the marker] Transaction k stages its parity range in scratch slot
k % 2. The graph updater with parity in host memory (`unbroken.update.graph`) writes it back on
a second stream, beside transaction k + 1, so the marker may run ahead of the write-backs:
transaction k waits for write-back k - 2 before its undo copy (slot k % 2 is free again), and
the update's IDLE waits for all of them. At marker position p, write-backs of p - 2 and p - 1
may be pending at SYNCED(p), of p - 1 at CHUNK_UPDATING(p), of p - 1 and p at PARITY_READY(p),
and their slots still hold their parity (the next writer of slot p % 2 is transaction p + 2,
and of slot (p - 1) % 2 transaction p + 1, neither started). `repair` therefore first writes
those slots back again, in transaction order (idempotent: the same bytes, the latest last),
whatever updater wrote the marker. Every updater uses the same slots, so this holds after a
host-marked or stream update too, where the write-backs happened to be complete. A lost
scratch page makes the slots unreadable: the groups concerned are encoded again from their
data (made consistent first) and the slots refilled from that parity, so a second repair
before the next commit writes back the same bytes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from unbroken.config import ProtectionConfig
from unbroken.erasure import PageTable, ProtectionGroup, UnrecoverableError
from unbroken.train.phases import Phase
from unbroken.train.state import TrainState
from unbroken.update.geometry import StateGeometry
from unbroken.update.kernel import ChunkStep
from unbroken.update.layout import (
    MARKER_PAGE,
    SCRATCH_SLOTS,
    SEGMENTS,
    GroupKind,
    RetainedLayout,
)
from unbroken.update.marker import (
    MARKER_BYTES,
    MarkerReplicas,
    MarkerState,
    ProgressMarker,
    Stage,
)

__all__ = [
    "NothingRetained",
    "RepairReport",
    "ResumableUpdater",
    "copy_rows",
    "local_allocator",
    "state_from_regions",
]

Hook = Callable[[Phase, int, int, int], None]


def _noop(phase: Phase, iteration: int, step: int, n: int) -> None:
    return None


class NothingRetained(Exception):
    """The marker records no completed write: the trainer that owned these regions died before
    `initialize` finished its first marker write (typically during its start-up). Nothing was
    lost — the regions never held progress, so they are as good as new ones — but there is
    nothing to resume either: the rank must start from the job's start (or a checkpoint).

    [Note: no valid marker slot] Each write goes to the slot the previous write did not use, so
    once one write has completed a crash always leaves a valid slot; with the marker page itself
    lost, its parity (encoded after each write) rebuilds it at most one write behind. A marker
    without a valid slot after that is therefore one whose first write never completed, not a
    damaged one.
    """


@dataclass(slots=True)
class RepairReport:
    lost_pages: dict[str, list[int]] = field(default_factory=dict)
    fixup: str = "none"
    reconstruct_ms: float = 0.0
    groups_repaired: int = 0
    marker: dict[str, object] = field(default_factory=dict)
    """The marker `repair` found: stage (name), iteration, group, chunk (where the crash left
    the update; the kill campaign classifies its kills by it)."""


def copy_rows(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst[:] = src for [rows, bytes] views, stream-ordered between host memory registered
    with CUDA and the device: one copy when both are contiguous, else one per row (torch would
    stage a strided host side through a pageable temporary, synchronously — and refuse it
    inside a CUDA graph capture)."""
    if dst.device == src.device or (dst.is_contiguous() and src.is_contiguous()):
        dst.copy_(src, non_blocking=True)
        return
    for d, s in zip(dst, src, strict=True):
        d.copy_(s, non_blocking=True)


def state_from_regions(layout, geometry: StateGeometry, regions: dict[str, torch.Tensor]):
    """TrainState whose buffers are views of the retained `model` and `grads` regions."""
    n = geometry.padded_numel
    model = regions["model"][: 3 * n * 4].view(torch.float32)
    grads = regions["grads"][: n * 4].view(torch.float32)
    return TrainState(layout, model[:n], grads, model[n : 2 * n], model[2 * n :])


def local_allocator(
    prot: ProtectionConfig,
    regions: dict[str, torch.Tensor],
    *,
    pin_marker: bool = False,
    fresh: bool = True,
) -> Callable:
    """An `allocate` callback for `build_training` that holds the retained regions of `prot`'s
    layout in this process — no state manager (benchmarks and tests): each on the training
    device, the progress marker and the host regions of a GPU job in host memory as in a job
    (`RetainedLayout.host_regions`; the marker page-locked if `pin_marker`, the parity
    always), stored by name into `regions`. `fresh`: whether the state starts from its
    initial values."""

    def allocate(layout, geometry: StateGeometry, device):
        host = RetainedLayout.host_regions(prot) if device.type == "cuda" else frozenset()
        for spec in RetainedLayout.of(geometry, prot).regions():
            if spec.name == "marker":
                region = torch.zeros(spec.nbytes, dtype=torch.uint8, pin_memory=pin_marker)
            elif spec.name in host:
                region = torch.zeros(spec.nbytes, dtype=torch.uint8, pin_memory=True)
            else:
                region = torch.zeros(spec.nbytes, dtype=torch.uint8, device=device)
            regions[spec.name] = region
        return state_from_regions(layout, geometry, regions), fresh

    return allocate


class ResumableUpdater:
    """Crash-consistent update phase over retained regions (uint8 tensors by name)."""

    staging_bytes = 0
    """HBM the updater holds beside the retained regions (`GraphUpdater`'s staging of host
    parity; none here)."""

    def __init__(
        self,
        state: TrainState,
        geometry: StateGeometry,
        step: ChunkStep,
        regions: dict[str, torch.Tensor],
        prot: ProtectionConfig,
        *,
        backend: str = "auto",
    ) -> None:
        self.state = state
        self.geometry = geometry
        self.step = step
        self.prot = prot
        self.layout = layout = RetainedLayout.of(geometry, prot)
        self.chunks = geometry.chunks()
        self.hook: Hook = _noop
        g, s = geometry, geometry.page_bytes
        h1, h2, d = layout.parity_pages, layout.second_tier_pages, layout.stripe
        self.h1, self.h2, self.d = h1, h2, d
        self.model_pages = regions["model"][: SEGMENTS * g.segment_pages * s].view(-1, s)
        self.grad_pages = regions["grads"][: g.segment_pages * s].view(-1, s)
        w = layout.width
        par = regions["model_parity"][: g.groups * w * s].view(g.groups * w, s)
        gpar = regions["grad_parity"][: g.groups * w * s].view(g.groups * w, s)
        self.model_parity = par.view(g.groups, w, s)
        self._parity_pin = None
        """The model parity's registration with CUDA when the state is on a GPU and its parity
        in host memory (`RetainedLayout.host_regions`): the codec and the fused kernel read it
        in place, copies write it back."""
        self.parity_register_s = 0.0
        """Seconds the registration took (part of attaching the retained state)."""
        if self.model_pages.is_cuda and not par.is_cuda:
            from unbroken.update.host_pin import HostRegistration

            t0 = time.perf_counter()
            self._parity_pin = HostRegistration(regions["model_parity"], self.model_pages.device)
            self._parity_pin.ensure()
            self.parity_register_s = time.perf_counter() - t0
        self.groups = [
            self._group(layout, "model", i, self.model_pages, par, backend) for i in range(g.groups)
        ]
        self.grad_groups = [
            self._group(layout, "grads", i, self.grad_pages, gpar, backend) for i in range(g.groups)
        ]
        self.marker_pages = mk = regions["marker"][: 3 * MARKER_PAGE].view(3, MARKER_PAGE)
        self.marker_group = MarkerReplicas(mk)
        self.marker = ProgressMarker(mk[0][:MARKER_BYTES])
        c, dd = g.chunk_bytes, layout.data_pages("model")
        self.undo = regions["undo"][: dd * c].view(SEGMENTS, d, c)
        self.scratch = regions["scratch"][: SCRATCH_SLOTS * w * c].view(SCRATCH_SLOTS, w, c)
        """Staging slots: transaction k uses slot k % 2 ([Note: write-back behind the marker])."""
        self.undo_table = PageTable([self.undo[a, b] for a in range(SEGMENTS) for b in range(d)])
        self.s1_tables = [PageTable([sl[r] for r in range(h1)]) for sl in self.scratch]
        self.s2_tables = [PageTable([sl[h1 + r] for r in range(h2)]) for sl in self.scratch]
        # uint8 [segment_pages, S] views of the three segments, for chunk copies.
        seg = g.segment_pages
        self.segments = [self.model_pages[sg * seg : (sg + 1) * seg] for sg in range(SEGMENTS)]

    @staticmethod
    def _group(
        layout: RetainedLayout,
        kind: GroupKind,
        i: int,
        pages: torch.Tensor,
        parity: torch.Tensor,
        backend: str,
    ) -> ProtectionGroup:
        """Protection group `i` of the model or the gradients over the region views; parity
        in host memory beside data on a GPU is taken as mapped into the GPU (the updater
        registers it), where the codec runs."""
        tiers = [PageTable([parity[r] for r in layout.parity_rows(i, tier)]) for tier in (1, 2)]
        if pages.is_cuda and not parity.is_cuda:
            dev = f"cuda:{pages.device.index or 0}"
            tiers = [t.mapped_into(dev) if len(t) else t for t in tiers]
        return ProtectionGroup(
            layout.erasure(kind),
            [pages[r] for r in layout.group_rows(kind, i)],
            tiers[0],
            tiers[1],
            name=f"{kind}/g{i}",
            backend=backend,
        )

    # -- marker ---------------------------------------------------------------------------
    def _mark(self, **changes) -> MarkerState:
        new = self.marker.write(**changes)
        self.hook(Phase.MARKER, new.iteration, int(new.stage), len(Stage))
        self.marker_group.copy_range(*self.marker.last_slot)
        return new

    # -- steady state ---------------------------------------------------------------------
    def initialize(self, done_iter: int) -> None:
        """Encode all parity from the current state (fresh start or after a checkpoint load)."""
        for group in self.groups:
            group.encode()
        self.marker.read()
        self._mark(stage=Stage.IDLE, iteration=done_iter + 1, done_iter=done_iter, group=0, chunk=0)
        self.marker_group.encode()  # both slots into the copies (each write copies its own)

    def protect(self, iteration: int) -> None:
        for group in self.grad_groups:
            group.encode()
        self._mark(stage=Stage.GRADS_PROTECTED, iteration=iteration)

    def record_sync(
        self, iteration: int, *, loss: float, grad_norm: float, grad_scale: float, lr: float
    ) -> None:
        self._mark(
            stage=Stage.SYNCED,
            iteration=iteration,
            group=0,
            chunk=0,
            loss=loss,
            grad_norm=grad_norm,
            grad_scale=grad_scale,
            lr=lr,
        )

    def boundary(self, iteration: int) -> None:
        """The marker already says IDLE(done_iter = iteration) after the last chunk."""

    @property
    def transactions(self) -> int:
        """Chunk transactions per update: every chunk once per pass of the rule."""
        return self.step.passes * len(self.chunks)

    def _position(self, k: int) -> dict[str, int]:
        """Marker fields of transaction k: (group, chunk) of chunk k, numbered on across passes
        (pass p's groups follow pass p-1's), so a one-pass rule's marker is unchanged."""
        group, chunk = divmod(k, self.geometry.chunks_per_group)
        return {"group": group, "chunk": chunk}

    def _index(self, st: MarkerState) -> int:
        return st.group * self.geometry.chunks_per_group + st.chunk

    @staticmethod
    def _slot(k: int) -> int:
        """Transaction k's scratch slot."""
        return k % SCRATCH_SLOTS

    def update(self, iteration: int, *, lr: float, grad_scale: float, hook: Hook) -> None:
        """Run (or resume) the chunk transactions of `iteration` from the marker's position.
        Entering a pass (at its start or resumed inside it) derives the pass's buffer first."""
        st = self.marker.state
        if st.stage is not Stage.SYNCED or st.iteration != iteration:
            raise RuntimeError(f"update of {iteration} from marker {st}")
        self.hook = hook
        n = len(self.chunks)
        try:
            start = self._index(st)
            for k in range(start, self.transactions):
                if k == start or k % n == 0:
                    self.step.begin_pass(
                        k // n, self.state, step=iteration + 1, lr=lr, grad_scale=grad_scale
                    )
                self._transaction(iteration, k, lr, grad_scale)
        finally:
            self.hook = _noop

    def _chunk_data(self, sg: int, ref) -> torch.Tensor:
        d = self.d
        return self.segments[sg][ref.group * d : (ref.group + 1) * d, ref.byte_lo : ref.byte_hi]

    def _transaction(self, iteration: int, k: int, lr: float, grad_scale: float) -> None:
        pass_, chunk = divmod(k, len(self.chunks))
        ref, n = self.chunks[chunk], self.transactions
        self._save_undo(ref)
        self._mark(stage=Stage.CHUNK_UPDATING, **self._position(k))
        self.hook(Phase.UPDATE, iteration, k, n)
        s = self.state
        self.step(
            ref,
            s.params,
            s.grads,
            s.exp_avg,
            s.exp_avg_sq,
            step=iteration + 1,
            lr=lr,
            grad_scale=grad_scale,
            pass_=pass_,
        )
        self.hook(Phase.PARITY, iteration, k, n)
        self._stage_parity(ref, chunk, self._slot(k))
        self._mark(stage=Stage.PARITY_READY)
        self._write_back(ref, self._slot(k), iteration, k)
        self._commit(iteration, k)

    def _save_undo(self, ref) -> None:
        """The chunk's pre-update bytes of the three segments into the undo buffer."""
        for sg in range(SEGMENTS):
            self.undo[sg].copy_(self._chunk_data(sg, ref))

    def _stage_parity(self, ref, chunk: int, slot: int) -> None:
        """The chunk's new parity range (both tiers) into scratch slot `slot`, from the
        committed parity and the chunk's old (undo) and new bytes."""
        x, c = ref.byte_lo, self.geometry.chunk_bytes
        group = self.groups[ref.group]
        copy_rows(self.scratch[slot], self.model_parity[ref.group][:, x : x + c])
        t1 = group.first_tier.slice(x, c)
        s1, s2 = self.s1_tables[slot], self.s2_tables[slot]
        group.first_tier_codec.update_from_old_new(s1, self.undo_table, group.data.slice(x, c))
        group.second_tier_codec.update_from_old_new(s2, t1, s1)

    def _write_back(self, ref, slot: int, iteration: int = 0, k: int = 0) -> None:
        x, c, h1 = ref.byte_lo, self.geometry.chunk_bytes, self.h1
        par, scr = self.model_parity[ref.group], self.scratch[slot]
        copy_rows(par[:h1, x : x + c], scr[:h1])
        self.hook(Phase.WRITEBACK, iteration, k, self.transactions)
        copy_rows(par[h1:, x : x + c], scr[h1:])

    def _commit(self, iteration: int, k: int) -> None:
        if k + 1 == self.transactions:
            self._mark(stage=Stage.IDLE, done_iter=iteration, group=0, chunk=0)
        else:
            self._mark(stage=Stage.SYNCED, **self._position(k + 1))

    # -- recovery -------------------------------------------------------------------------
    def repair(self, lost: dict[str, list[int]]) -> RepairReport:
        """Make retained state consistent and whole after a failure, before anything else
        touches it: marker first, then the interrupted chunk, then lost pages from parity.

        Args:
            lost: region name -> indices of failed pages (in that region's pages), from the
                state manager's localization (never from the injector).

        Raises:
            NothingRetained: the marker was never written (see [Note: no valid marker slot]);
                nothing has been touched.
            UnrecoverableError: more losses than parity can repair, a lost marker beyond its
                parity, or a lost undo/scratch buffer that the interrupted chunk needs.
        """
        report = RepairReport(lost_pages={k: sorted(v) for k, v in lost.items() if v})
        t0 = time.perf_counter()
        if self._parity_pin is not None and lost.get("model_parity"):
            self._parity_pin.reregister()  # lost pages were given new memory at their address
        if lost.get("marker"):
            self.marker_group.reconstruct(lost["marker"])
        st = self.marker.read()
        if st is None:
            raise NothingRetained(
                "the progress marker has no completed write: its trainer died before "
                "initializing the retained state"
            )
        report.marker = {
            "stage": st.stage.name,
            "iteration": st.iteration,
            "group": st.group,
            "chunk": st.chunk,
        }
        n, p = len(self.chunks), self._index(st)
        if st.stage is Stage.CHUNK_UPDATING:  # the chunk's data back to its committed bytes
            if lost.get("undo"):
                raise UnrecoverableError(group="undo", lost=set(lost["undo"]))
            ref = self.chunks[p % n]
            for sg in range(SEGMENTS):
                self._chunk_data(sg, ref).copy_(self.undo[sg])
        self._finish_write_backs(self._pending(st), lost)
        if st.stage is Stage.CHUNK_UPDATING:
            self._mark(stage=Stage.SYNCED)
            report.fixup = f"restored chunk g{st.group}/c{st.chunk} from undo"
        elif st.stage is Stage.PARITY_READY:
            self._commit(st.iteration, p)
            report.fixup = f"rolled chunk g{st.group}/c{st.chunk} parity forward"
        report.groups_repaired += self._reconstruct(
            self.groups, lost.get("model", []), lost.get("model_parity", []), 3
        )
        if self.marker.state.stage is not Stage.IDLE:
            report.groups_repaired += self._reconstruct(
                self.grad_groups, lost.get("grads", []), lost.get("grad_parity", []), 1
            )
        report.reconstruct_ms = (time.perf_counter() - t0) * 1e3
        return report

    def _pending(self, st: MarkerState) -> list[int]:
        """Transactions whose write-back may not have landed at marker `st` ([Note: write-back
        behind the marker]), in order."""
        p = self._index(st)
        first = {Stage.SYNCED: p - 2, Stage.CHUNK_UPDATING: p - 1, Stage.PARITY_READY: p - 1}
        if st.stage not in first:
            return []
        last = p if st.stage is Stage.PARITY_READY else p - 1
        return list(range(max(first[st.stage], 0), last + 1))

    def _finish_write_backs(self, pending: list[int], lost: dict[str, list[int]]) -> None:
        """Write the pending transactions' slots back; with scratch pages lost, encode their
        groups again from the (consistent) data and refill the slots from it instead."""
        n = len(self.chunks)
        if not lost.get("scratch"):
            for k in pending:
                self._write_back(self.chunks[k % n], self._slot(k))
            return
        groups = sorted({self.chunks[k % n].group for k in pending})
        damaged = self.layout.lost_by_group("model", lost.get("model", []), [])
        for g in groups:
            if g in damaged:  # neither its data nor its staged parity can be trusted
                raise UnrecoverableError(group=f"model/g{g}", lost=set(lost["scratch"]))
            self.groups[g].encode()
        c = self.geometry.chunk_bytes
        for k in pending:
            ref = self.chunks[k % n]
            par = self.model_parity[ref.group][:, ref.byte_lo : ref.byte_lo + c]
            copy_rows(self.scratch[self._slot(k)], par)

    def _reconstruct(
        self, groups: list[ProtectionGroup], data_lost: list[int], parity_lost: list[int], segs: int
    ) -> int:
        kind: GroupKind = "model" if segs == SEGMENTS else "grads"
        per_group = self.layout.lost_by_group(kind, data_lost, parity_lost)
        for grp, pages in sorted(per_group.items()):
            groups[grp].reconstruct(pages)
        return len(per_group)
