"""The resumable updater on a CUDA stream: the same chunk transactions, markers and recovery as
`ResumableUpdater`, with every marker write made by the stream (`DeviceMarker`) and the
transaction's work enqueued without a host round trip.

Why a subclass and not a flag: the host-written marker of `ResumableUpdater` is correct on the
CPU (a host write follows the host's own completed work) and wrong on a GPU, where the host
writes it while the kernels it describes may still be queued (issue 16, item 3). Here:

- every `_mark` (initialize, protect, record_sync, each chunk's three stages, repair's fixups)
  computes the next state on the host (`ProgressMarker.advance`) and enqueues its write: the
  write lands after every kernel enqueued before it, and a crash inside it leaves a torn slot
  that `read` ignores (see `unbroken.update.device_marker`);
- a chunk's undo copy is one contiguous copy per segment (whole-page chunks) or one launch
  over the three segments' strided views;
- the parity deltas run the codec's kernel over pointer tables built once per chunk at start-up
  (`TritonCodec.update_from_old_new_ptrs`) instead of resolving page tables per call;
- the host mirror of the marker (`ProgressMarker.state`) runs ahead of the device; nothing on
  the host reads the marker's memory while this trainer lives, and `repair`, `initialize` and
  the end of `update` wait for the stream so the state they report has landed.

Crash semantics are those of Pseudocode 1: a kill at any moment (the host anywhere, the device
anywhere in its queue) leaves the last completed marker write, whose stage's fix-up `repair`
applies. The arithmetic is the same kernels' as the host-marked updater's, so the two compute
identical bits (a GPU test holds it).
"""

from __future__ import annotations

import warnings

import torch

from unbroken.native import NativeUnavailableError
from unbroken.train.phases import Phase
from unbroken.update.device_marker import DeviceMarker
from unbroken.update.layout import SEGMENTS, RetainedLayout
from unbroken.update.lending import LendingPool, LentMemoryInUse
from unbroken.update.marker import MarkerState, Stage
from unbroken.update.rmu import RepairReport, ResumableUpdater, copy_rows

__all__ = ["StreamUpdater", "stream_capable"]

_LENT = ("grad_parity", "undo", "scratch")
"""Regions read only from the gradients' protection to the end of an update: lent to the
compute phase in between (`unbroken.update.lending`)."""


def stream_capable(state, regions: dict[str, torch.Tensor], prot, backend: str = "auto") -> bool:
    """Whether an updater over this state and these regions can take the stream path: state,
    model pages and undo buffer on a CUDA device (whose only codec backend is Triton's), at
    most 16 pages per parity tier. Decided from the inputs, before any updater is built."""
    cuda = state.params.is_cuda and regions["model"].is_cuda and regions["undo"].is_cuda
    h1 = RetainedLayout.tiers_of(prot).parity_pages  # as the updater's layout reads it
    tiers = h1 <= 16 and prot.second_tier_pages <= 16
    return cuda and tiers and backend in ("auto", "triton")


def _device_ptrs(rows: list, device: torch.device) -> torch.Tensor:
    """[n, k] int64 device tensor of n page tables' addresses."""
    host = torch.tensor([[int(p) for p in r] for r in rows], dtype=torch.int64)
    return host.to(device)


class StreamUpdater(ResumableUpdater):
    """`ResumableUpdater` with stream-ordered markers (see the module docstring)."""

    def __init__(self, state, geometry, step, regions, prot, **kwargs) -> None:
        super().__init__(state, geometry, step, regions, prot, **kwargs)
        from unbroken.erasure.cuda_backend import TritonCodec  # imports Triton: CUDA only

        codecs = [g.first_tier_codec for g in self.groups]
        codecs += [g.second_tier_codec for g in self.groups if g.second_tier_codec is not None]
        if not all(isinstance(c, TritonCodec) for c in codecs) or max(self.h1, self.h2) > 16:
            raise ValueError("the stream updater needs Triton codecs of at most 16 pages a tier")
        dev = self.state.params.device
        self.device = dev
        self.dmarker = DeviceMarker(self.marker_pages, dev)
        g = self.geometry
        self._model3 = self.model_pages.view(SEGMENTS, g.segment_pages, g.page_bytes)
        c = g.chunk_bytes
        self._undo_ptrs = _device_ptrs([self.undo_table.ptrs], dev)[0]
        self._s1_ptrs = _device_ptrs([t.ptrs for t in self.s1_tables], dev)
        self._s2_ptrs = _device_ptrs([t.ptrs for t in self.s2_tables], dev) if self.h2 else None
        new_rows, t1_rows = [], []
        for ref in self.chunks:
            group = self.groups[ref.group]
            new_rows.append(group.data.slice(ref.byte_lo, c).ptrs)
            t1_rows.append(group.first_tier.slice(ref.byte_lo, c).ptrs)
        self._new_ptrs = _device_ptrs(new_rows, dev)
        self._t1_ptrs = _device_ptrs(t1_rows, dev)
        self.lending: LendingPool | None = None
        """The compute phase's pool over the buffers only an update needs (`unbroken.update.
        lending`); None when `protection.lend_activations` is off."""
        if prot.lend_activations:
            lent = [regions[k] for k in _LENT if regions[k].is_cuda]
            try:
                self.lending = LendingPool(lent, dev)
            except (NativeUnavailableError, LentMemoryInUse) as exc:
                warnings.warn(
                    f"training without lending the protection buffers: {exc}", stacklevel=2
                )

    def _sync(self) -> None:
        torch.cuda.current_stream(self.device).synchronize()

    # -- marker -------------------------------------------------------------------------------
    def _mark(self, **changes) -> MarkerState:
        new = self.marker.advance(**changes)
        self.dmarker.write(new)
        self.hook(Phase.MARKER, new.iteration, int(new.stage), len(Stage))
        return new

    # -- steady state -------------------------------------------------------------------------
    def initialize(self, done_iter: int) -> None:
        for group in self.groups:
            group.encode()
        self.marker.read()
        self._mark(stage=Stage.IDLE, iteration=done_iter + 1, done_iter=done_iter, group=0, chunk=0)
        self._sync()
        self.marker_group.encode()

    def protect(self, iteration: int) -> None:
        if self.lending is not None:
            self.lending.reclaim()  # the gradient parity, undo and scratch are ours again
        super().protect(iteration)

    def update(self, iteration: int, *, lr: float, grad_scale: float, hook) -> None:
        super().update(iteration, lr=lr, grad_scale=grad_scale, hook=hook)
        self._sync()  # the next iteration's compute reads the parameters anyway

    def _save_undo(self, ref) -> None:
        """Whole-page chunks: one contiguous copy per segment (device-to-device memcpy, about
        3.9 TB/s on an H200 against 3.25 TB/s for the strided copy kernel); else one launch
        over the three segments' strided views of the chunk."""
        d, x, c = self.d, ref.byte_lo, self.geometry.chunk_bytes
        rows = slice(ref.group * d, (ref.group + 1) * d)
        if c == self.geometry.page_bytes:
            for sg in range(SEGMENTS):
                self.undo[sg].copy_(self._model3[sg, rows])
            return
        self.undo.copy_(self._model3[:, rows, x : x + c])

    def _stage_parity(self, ref, chunk: int, slot: int) -> None:
        """The codec's kernel over the pointer tables built at start-up."""
        c = self.geometry.chunk_bytes
        group = self.groups[ref.group]
        copy_rows(
            self.scratch[slot], self.model_parity[ref.group][:, ref.byte_lo : ref.byte_lo + c]
        )
        s1 = self._s1_ptrs[slot]
        group.first_tier_codec.update_from_old_new_ptrs(
            self._undo_ptrs, self._new_ptrs[chunk], s1, length=c
        )
        if self._s2_ptrs is not None:
            group.second_tier_codec.update_from_old_new_ptrs(
                self._t1_ptrs[chunk], s1, self._s2_ptrs[slot], length=c
            )

    # -- recovery -----------------------------------------------------------------------------
    def repair(self, lost: dict[str, list[int]]) -> RepairReport:
        """`ResumableUpdater.repair`, the marker pages registered again (the manager may have
        given lost pages new memory) and the fix-ups' writes landed before it returns."""
        self.dmarker.reregister()
        report = super().repair(lost)
        self._sync()
        return report
