"""The resumable update of an iteration as one CUDA graph: the stream updater's transactions,
markers included, captured once and replayed with one launch per iteration.

Each transaction is the fused one of `unbroken.update.transaction` where its kernel covers the
tiers (six launches: undo copy, marker, step + parity staging, marker, write-back, marker; its
crash semantics are written there), else the ten launches below (``fused=False`` keeps them,
for comparisons).

Why a graph: a chunk transaction enqueues ten launches (the undo copy, three marker writes, the AdamW
step, the parity staging copy, two codec updates, two write-back copies) from Python, and at
hundreds of chunks the update is bound by the host's enqueue time, not by the device (stop 27:
489 ms for 904 chunks on the H200 against 6.9 ms for the plain update's one launch). Every
iteration runs the same kernels on the same addresses; only the step's scalars and the
marker's iteration fields change. So the kernels that carry them read them from two device
blocks (`fused_adamw_dev_`: the eight AdamW scalars; `DeviceMarker.write_at`: sequence
number, iteration, done_iter, loss, norm, scale, lr), which the host refreshes before each
replay, and everything else is fixed at capture.

With the model's parity in host memory (the default on a GPU: `ProtectionConfig.parity_memory`)
each fused transaction's committed parity range is copied into HBM ahead of its kernel and its
new parity back behind it, on two copy streams (`unbroken.update.host_parity`); the marker may
then run ahead of the write-backs, which `repair` writes again ([Note: write-back behind the
marker] in `unbroken.update.rmu`).

Crash semantics are the stream updater's: the graph is the same kernels in the same
stream order, each marker write lands after the work it records and a torn one is ignored
(`unbroken.update.device_marker`), and `repair` is `StreamUpdater.repair`. A kill at any wall
time — the host anywhere, the device anywhere in the graph — leaves the last completed marker
write. Arithmetic: the same kernel bodies as the stream and plain updaters (fp32 loads of the
scalars hold the values the scalar launch rounds to), so the bits are the same (GPU tests).

What is not captured:
- a resumed update (the marker inside the iteration after a crash: `StreamUpdater.update`
  runs the transactions from there; one iteration, once per failure);
- rules other than one-pass AdamW with one decay boundary (`ChunkStep.fused_adamw`): masks
  and multi-pass rules take the stream updater (`unbroken.update.factory`).

Capture happens at the first fresh update (a few ms per hundred transactions, plus instantiation)
and again after `repair`, which may give lost pages new memory. Hooks (fault injection, phase
reporting) are called for every transaction, in the host-marked order, after the replay is
launched: the device works meanwhile, so an injected kill lands wherever the device has got to,
as an external kill does.
"""

from __future__ import annotations

import time

import torch

from unbroken.train.phases import Phase
from unbroken.update.fused_adamw import AdamWCoefficients, fused_adamw_dev_
from unbroken.update.host_parity import HostParityStreams
from unbroken.update.marker import Stage
from unbroken.update.rmu import RepairReport
from unbroken.update.stream import StreamUpdater
from unbroken.update.transaction import FusedTransaction, fused_capable

__all__ = ["GraphUpdater", "graph_capable"]

_WRITES = 3
"""Marker writes per transaction: CHUNK_UPDATING, PARITY_READY, the commit."""


def graph_capable(step) -> bool:
    """Whether `step` (a `ChunkStep`) is the one the graph captures (see the module
    docstring)."""
    return step.fused_adamw and step.passes == 1


class GraphUpdater(StreamUpdater):
    """`StreamUpdater` whose fresh updates replay one CUDA graph (see the module docstring)."""

    def __init__(self, *args, fused: bool = True, fused_tuning=None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if not graph_capable(self.step):
            raise ValueError("the graph updater captures one-pass AdamW with one decay boundary")
        dev = self.device
        self.fused: FusedTransaction | None = None
        """The fused step + parity staging (`unbroken.update.transaction`); None: the
        ten-launch transaction (``fused=False``, or tiers the kernel does not cover)."""
        if fused and fused_capable(self.h1, self.h2):
            self.fused = FusedTransaction.of(self, fused_tuning)
        self._coef_host = torch.zeros(8, dtype=torch.float32, pin_memory=True)
        self._base_host = torch.zeros(8, dtype=torch.int64, pin_memory=True)
        self._coef = torch.zeros(8, dtype=torch.float32, device=dev)
        self._base = torch.zeros(8, dtype=torch.int64, device=dev)
        self._graph: torch.cuda.CUDAGraph | None = None
        self._host: HostParityStreams | None = None
        """Staging and write-back of parity in host memory (fused transactions); None: the
        parity is in HBM, read in place and written back in line (device to device)."""
        if self.fused is not None and not self.model_parity.is_cuda:
            c = self.geometry.chunk_bytes
            self._host = HostParityStreams(self.model_parity, self.scratch, c, dev)
        self._held: list[torch.Tensor] = []
        self.captures = 0
        """How many times the update was captured (a test and the bench read it)."""
        self.capture_s = 0.0
        """Host seconds of the last capture (recording and instantiation)."""

    @property
    def staging_bytes(self) -> int:
        """HBM this updater holds beside the retained regions (the host parity's staging)."""
        return 0 if self._host is None else self._host.stage.numel()

    # -- steady state -------------------------------------------------------------------------
    def update(self, iteration: int, *, lr: float, grad_scale: float, hook) -> None:
        st = self.marker.state
        if st.stage is not Stage.SYNCED or st.iteration != iteration or self._index(st) != 0:
            super().update(iteration, lr=lr, grad_scale=grad_scale, hook=hook)
            return
        self.step.begin_pass(0, self.state, step=iteration + 1, lr=lr, grad_scale=grad_scale)
        self._load(iteration, lr=lr, grad_scale=grad_scale)
        if self._graph is None:
            self._graph = self._capture()
        self._graph.replay()
        n = self.transactions
        for k in range(n):
            self._hooks(hook, iteration, k, n)
        self.marker.skip(_WRITES * n, stage=Stage.IDLE, done_iter=iteration, group=0, chunk=0)
        self._sync()

    def _load(self, iteration: int, *, lr: float, grad_scale: float) -> None:
        """The replay's scalars into the device blocks (stream-ordered; the last update's
        `_sync` made the pinned sources free to overwrite)."""
        opt = self.step.optimizer
        coeffs = AdamWCoefficients.of(opt, step=iteration + 1, lr=lr, grad_scale=grad_scale)
        self._coef_host.numpy()[:] = coeffs.values()
        self._base_host.numpy()[:7] = self.dmarker.base_words(self.marker.state)
        self._coef.copy_(self._coef_host, non_blocking=True)
        self._base.copy_(self._base_host, non_blocking=True)

    def _hooks(self, hook, iteration: int, k: int, n: int) -> None:
        """Transaction k's hook calls, in `ResumableUpdater._transaction`'s order."""
        hook(Phase.MARKER, iteration, int(Stage.CHUNK_UPDATING), len(Stage))
        hook(Phase.UPDATE, iteration, k, n)
        hook(Phase.PARITY, iteration, k, n)
        hook(Phase.MARKER, iteration, int(Stage.PARITY_READY), len(Stage))
        hook(Phase.WRITEBACK, iteration, k, n)
        last = Stage.IDLE if k + 1 == n else Stage.SYNCED
        hook(Phase.MARKER, iteration, int(last), len(Stage))

    # -- the capture --------------------------------------------------------------------------
    def _capture(self) -> torch.cuda.CUDAGraph:
        """Every transaction of a fresh update, in order, into one graph. Relaxed mode: a
        kernel's first launch may load its module during the capture. Nothing in the captured
        calls may copy from pageable host memory (torch refuses it during a capture)."""
        t0 = time.perf_counter()
        codecs = [g.first_tier_codec for g in self.groups]
        codecs += [g.second_tier_codec for g in self.groups if g.second_tier_codec is not None]
        # The graph launches with these tables' addresses: built before the capture (no copy
        # inside it) and held while the graph lives.
        self._held = [codec.prepare_pointer_updates() for codec in codecs]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="relaxed"):
            if self._host is not None:
                self._host.begin()
            for k in range(self.transactions):
                self._captured_transaction(k)
        self.captures += 1
        self.capture_s = time.perf_counter() - t0
        return graph

    def _captured_transaction(self, k: int) -> None:
        """`ResumableUpdater._transaction` of transaction k with the scalars on the device."""
        ref, s, slot, host = self.chunks[k], self.state, self._slot(k), self._host
        if host is not None:
            host.before_undo(k)
        self._save_undo(ref)
        self._mark_at(k, 1, Stage.CHUNK_UPDATING, **self._position(k))
        if self.fused is not None:
            first, end = self.step.first_index(ref), self.step.decay_end
            committed = None if host is None else host.committed(ref, k)
            self.fused.launch(
                ref, self._coef, first_index=first, decay_end=end, slot=slot, committed=committed
            )
            self._mark_at(k, 2, Stage.PARITY_READY, **self._position(k))
            if host is None:
                x, c = ref.byte_lo, self.geometry.chunk_bytes
                self.model_parity[ref.group][:, x : x + c].copy_(self.scratch[slot])
            else:
                host.after_kernel(k)
                host.write_back(ref, slot, k)
            self._commit_at(k)
            return
        p, g, m, v = (
            self.geometry.chunk_view(t, ref) for t in (s.params, s.grads, s.exp_avg, s.exp_avg_sq)
        )
        fused_adamw_dev_(
            p,
            g,
            m,
            v,
            self._coef,
            first_index=self.step.first_index(ref),
            decay_end=self.step.decay_end,
        )
        self._stage_parity(ref, k, slot)
        self._mark_at(k, 2, Stage.PARITY_READY, **self._position(k))
        self._write_back(ref, slot)
        self._commit_at(k)

    def _commit_at(self, k: int) -> None:
        """Write 3 of transaction k: the next chunk's SYNCED, or IDLE after the last (which
        waits for every write-back: the update is then whole in host memory too)."""
        if k + 1 == self.transactions:
            if self._host is not None:
                self._host.join()
            self._mark_at(k, 3, Stage.IDLE, group=0, chunk=0, idle=True)
        else:
            self._mark_at(k, 3, Stage.SYNCED, **self._position(k + 1))

    def _mark_at(
        self, k: int, j: int, stage: Stage, *, group: int, chunk: int, idle: bool = False
    ) -> None:
        """Write j (1-3) of transaction k, its sequence number relative to the update's start."""
        self.dmarker.write_at(
            self._base,
            seq_off=_WRITES * k + j,
            stage=int(stage),
            group=group,
            chunk=chunk,
            idle=idle,
        )

    # -- recovery -----------------------------------------------------------------------------
    def repair(self, lost: dict[str, list[int]]) -> RepairReport:
        """`StreamUpdater.repair`; the next fresh update captures again (the manager may have
        given lost pages new memory, which the graph's addresses would miss)."""
        self._graph = None
        return super().repair(lost)
