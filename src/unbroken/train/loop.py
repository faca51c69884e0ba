"""One training iteration, phase by phase, on flat state (the iteration contract).

compute (forward/backward per micro-batch, gradients land in the flat gradient buffer, then
summed over replicas bucket by bucket: hooks ALLREDUCE b before each bucket, REDUCED after) →
protect (hooks only here; parity of the gradient buffer attaches in in-place recovery) →
sync (sum gradients over data-parallel replicas in a fixed order, global norm, clip factor) →
update (AdamW chunk by chunk over the flat buffers) → boundary.

The model state is read-only until the update phase, so a crash before it is handled by
redoing the iteration with the same inputs (the sampler is pure).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from unbroken.config import TrainConfig
from unbroken.train.ordered import OrderedGradients, Placement
from unbroken.train.phases import Phase, PhaseHook
from unbroken.train.rng import seed_microbatch
from unbroken.train.state import TrainState
from unbroken.train.tail import Updater, finish_iteration

__all__ = ["BatchSource", "IterationResult", "LossFn", "Trainer", "reference_loss"]


class BatchSource(Protocol):
    """Where micro-batches come from: a pure function of (iteration, shard)."""

    def iteration(self, iteration: int, shard: int) -> Sequence[Any]: ...


LossFn = Callable[[nn.Module, Any, torch.device], torch.Tensor]
"""(model, micro-batch, device) -> mean loss of that micro-batch."""


def reference_loss(model: nn.Module, mb: Any, device: torch.device) -> torch.Tensor:
    """Loss of the reference transformer on a packed `MicroBatch` (its document lengths go
    along from the host, so attending by documents needs no device read)."""
    args = [
        t.to(device, non_blocking=True)
        for t in (mb.tokens, mb.targets, mb.segment_ids, mb.positions)
    ]
    return model(*args, doc_lengths=mb.doc_lengths)


_REDUCE_BUCKET = 1 << 25  # elements per all_reduce call


@dataclass(frozen=True, slots=True)
class IterationResult:
    iteration: int
    loss: float
    grad_norm: float
    lr: float
    tokens: int
    doc_lengths: tuple[tuple[int, ...], ...]
    """Segment lengths of each micro-batch this rank computed (its workload)."""
    t_start: float
    t_end: float
    microbatches: tuple[int, ...] = ()
    """A plan's global ids of the micro-batches in `doc_lengths` (`unbroken.engine`); empty for
    the data-parallel trainer, whose `doc_lengths` are its shard's micro-batches in order."""

    @property
    def seconds(self) -> float:
        return self.t_end - self.t_start


def _microbatch(source: BatchSource, iteration: int, shard: int, index: int) -> Any:
    """Micro-batch `index` of `shard` (a source with `get`, as `unbroken.data.Sampler`, gives
    it alone; any other, from its shard's list)."""
    get = getattr(source, "get", None)
    if get is not None:
        return get(iteration, shard, index)
    return source.iteration(iteration, shard)[index]


class Trainer:
    """Runs iterations of one data-parallel rank over flat state.

    Args:
        model: a module whose parameters are views of `state.params` (see `materialize`) and
            whose forward takes a micro-batch's (tokens, targets, segment_ids, positions) and
            returns the mean loss.
        state: the flat buffers.
        source: the deterministic micro-batch source (e.g. `unbroken.data.Sampler`).
        loss_fn: computes a micro-batch's loss (default: the reference model's).
        shard: this rank's logical data shard.
        cfg: optimizer and schedule.
        group: the data-parallel process group (None for a single process).
        device: where to compute.
        autocast_dtype: bf16 on GPU, None for fp32.
        hooks: called at the start of every phase step.
        updater: runs the update phase chunk by chunk (`unbroken.update`); protection, undo and
            the progress marker live there.
        reduce_bucket: elements per gradient all-reduce call (one ALLREDUCE hook each).
        placement: who computes which logical micro-batch (`unbroken.parallel.DataPlacement`):
            given, the rank computes its micro-batches of any shard and the gradients are
            reduced in a fixed order ([Note: ordered reduction] in `unbroken.train.ordered`),
            so any placement gives the same bits; None, the rank computes shard `shard`'s
            micro-batches and gradients are all-reduced (the default path). A placement may
            give a rank none (an empty replica, `unbroken.plan.balance`): it joins the ordered
            reduction with no row and steps.
        probe_every: such a rank runs a probe micro-batch every this many iterations (`_probe`;
            0: never).
    """

    def __init__(
        self,
        *,
        model: nn.Module,
        state: TrainState,
        source: BatchSource,
        shard: int,
        cfg: TrainConfig,
        group: dist.ProcessGroup | None,
        device: torch.device,
        autocast_dtype: torch.dtype | None = None,
        hooks: Sequence[PhaseHook] = (),
        updater: Updater,
        loss_fn: LossFn = reference_loss,
        reduce_bucket: int = _REDUCE_BUCKET,
        placement: Placement | None = None,
        probe_every: int = 0,
    ) -> None:
        if reduce_bucket < 1:
            raise ValueError(f"reduce_bucket must be >= 1 element, got {reduce_bucket}")
        self.model = model
        self.state = state
        self.source = source
        self.loss_fn = loss_fn
        self.shard = shard
        self.cfg = cfg
        self.group = group
        self.device = device
        self.autocast_dtype = autocast_dtype
        self.hooks = list(hooks)
        self.updater = updater
        self.dp = dist.get_world_size(group) if group is not None else 1
        self.reduce_bucket = reduce_bucket
        self.ordered: OrderedGradients | None = None
        self.probe_every = probe_every
        """A rank the placement gives no micro-batch runs a probe every this many iterations
        (0: never; `_probe`)."""
        self._tokens = 0
        self.lending = getattr(updater, "lending", None)
        """The updater's pool over its lent buffers (`unbroken.update.lending`): forward and
        backward allocate there; None: in torch's default pool."""
        if placement is not None:
            self.set_placement(placement)

    def set_placement(self, placement: Placement) -> None:
        """Compute `placement`'s micro-batches of this rank from the next iteration on (every
        rank switches at the same boundary: the caller agrees on it collectively)."""
        rank = dist.get_rank(self.group) if self.group is not None else 0
        if len(placement.items) != self.dp:
            raise ValueError(f"a placement of {len(placement.items)} ranks in a world of {self.dp}")
        self.ordered = OrderedGradients(self.state.grads, placement, rank, self.group)

    def _hook(self, phase: Phase, iteration: int, step: int = 0, n_steps: int = 1) -> None:
        for hook in self.hooks:
            hook(phase, iteration, step, n_steps)

    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def _lent(self):
        if self.lending is None:
            return contextlib.nullcontext()
        return self.lending.compute()

    def _unlent(self):
        """Hooks inside the lent phase run outside the pool (`LendingPool.paused`)."""
        if self.lending is None:
            return contextlib.nullcontext()
        return self.lending.paused()

    def compute(self, iteration: int) -> tuple[float, int, tuple[tuple[int, ...], ...]]:
        """Forward/backward over this shard's micro-batches, then the data-parallel gradient
        average (DDP-style, still the compute phase: a crash here redoes the iteration). Each
        micro-batch runs with torch's generators seeded from its key (`unbroken.train.rng`)."""
        if self.ordered is not None:
            return self._compute_ordered(iteration, self.ordered)
        self.state.grads.zero_()
        batches = self.source.iteration(iteration, self.shard)
        # The loss stays on the device until every micro-batch and the all-reduce are
        # enqueued: reading it per micro-batch would make the host wait for each forward
        # before it could launch the backward. float64, summed in order: the same value as
        # adding the Python floats.
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        tokens = 0
        for m, mb in enumerate(batches):
            self._hook(Phase.FORWARD, iteration, m, len(batches))
            seed_microbatch(self.cfg.seed, iteration, self.shard, m)
            with self._lent():
                with self._autocast():
                    loss = self.loss_fn(self.model, mb, self.device) / len(batches)
                with self._unlent():
                    self._hook(Phase.BACKWARD, iteration, m, len(batches))
                loss.backward()
                total += loss.detach().double()
            del loss  # lent memory: nothing of the micro-batch outlives its compute phase
            tokens += int(getattr(mb, "n_tokens", 0))
        grads = self.state.grads
        if self.group is not None and self.dp > 1:
            size = self.reduce_bucket
            starts = range(0, grads.numel(), size)
            for b, a in enumerate(starts):
                self._hook(Phase.ALLREDUCE, iteration, b, len(starts))
                dist.all_reduce(grads[a : a + size], group=self.group)
            grads.div_(self.dp)
            self._hook(Phase.REDUCED, iteration)
        lengths = tuple(tuple(getattr(mb, "doc_lengths", ())) for mb in batches)
        return float(total), tokens, lengths

    def _compute_ordered(
        self, iteration: int, ordered: OrderedGradients
    ) -> tuple[float, int, tuple[tuple[int, ...], ...]]:
        """The compute phase of the ordered path: each of this rank's micro-batches alone,
        keyed by its logical (shard, index), then the ordered reduction."""
        self.state.grads.zero_()
        items = ordered.items
        lengths = []
        for j, k in enumerate(items):
            mb = _microbatch(self.source, iteration, *ordered.placement.key(k))
            loss = self._forward_backward(iteration, j, len(items), ordered, k, mb)
            ordered.keep(j, loss, int(getattr(mb, "n_tokens", 0)))  # copies the loss's value
            del loss  # lent memory: nothing of the micro-batch outlives its compute phase
            lengths.append(tuple(getattr(mb, "doc_lengths", ())))
        if not items and self.probe_every > 0 and iteration % self.probe_every == 0:
            lengths.append(self._probe(iteration, ordered))
        ordered.reduce(self._hook, iteration)
        return 0.0, 0, tuple(lengths)

    def _forward_backward(
        self, iteration: int, step: int, n_steps: int, ordered: OrderedGradients, k: int, mb
    ) -> torch.Tensor:
        """Global micro-batch `k` (data `mb`) forward and backward as this rank's phase step
        `step` of `n_steps`, torch's generators seeded from its logical (shard, index); returns
        its loss over the placement's micro-batches per shard (the ordered path's scale)."""
        shard, m = ordered.placement.key(k)
        self._hook(Phase.FORWARD, iteration, step, n_steps)
        seed_microbatch(self.cfg.seed, iteration, shard, m)
        with self._lent():
            with self._autocast():
                loss = self.loss_fn(self.model, mb, self.device) / ordered.placement.microbatches
            with self._unlent():
                self._hook(Phase.BACKWARD, iteration, step, n_steps)
            loss.backward()
        return loss

    def _probe(self, iteration: int, ordered: OrderedGradients) -> tuple[int, ...]:
        """A rank with no micro-batch: micro-batch 0 of the global batch (which another rank
        computes for real) forward and backward as this rank's step 0 of 1 (the same work as
        that rank's, `_forward_backward`), so that a slow
        device is slow for it too, the timer (`unbroken.detect.timing.PhaseTimer`) times it
        as the rank's one micro-batch and the fail-slow watch sees when the device runs at
        its peers' pace again ([Note: probe micro-batch] in `unbroken.engine.probe`, the
        same for a plan's empty replica). Nothing of it is left: its gradient is zeroed
        (this rank adds no row to the ordered fold), its loss and tokens are not counted, the
        RNG state is restored. Returns its segment lengths (the rank's workload this
        iteration, `IterationResult.doc_lengths`)."""
        mb = _microbatch(self.source, iteration, *ordered.placement.key(0))
        rng = torch.get_rng_state()
        cuda = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        try:
            self._forward_backward(iteration, 0, 1, ordered, 0, mb)  # its loss is dropped
        finally:
            torch.set_rng_state(rng)
            if cuda is not None:
                torch.cuda.set_rng_state(cuda, self.device)
        self.state.grads.zero_()
        return tuple(getattr(mb, "doc_lengths", ()))

    def sync(self, iteration: int, local_loss: float) -> tuple[float, float, float]:
        """Global synchronization: no rank passes it before every rank has protected its
        gradients; agrees on the loss. Returns (loss, grad_norm, clip factor)."""
        self._hook(Phase.SYNC, iteration)
        grads = self.state.grads
        if self.ordered is not None:
            loss, self._tokens = self.ordered.sync_stats()
            loss_t = torch.tensor([loss], dtype=torch.float64)
        else:
            loss_t = torch.tensor([local_loss], dtype=torch.float64, device=self.device)
        if self.ordered is None and self.group is not None and self.dp > 1:
            dist.all_reduce(loss_t, group=self.group)
            loss_t.div_(self.dp)
        # float64: the same sum however the gradient is split (TP shards, pipeline stages)
        norm = float(torch.linalg.vector_norm(grads, dtype=torch.float64))
        clip = self.cfg.grad_clip
        scale = min(1.0, clip / (norm + 1e-6)) if clip > 0 else 1.0
        return float(loss_t), norm, scale

    def run_iteration(self, iteration: int) -> IterationResult:
        t0 = time.time()
        local_loss, tokens, lengths = self.compute(iteration)
        stats = finish_iteration(
            self.updater, self._hook, self.cfg, iteration, lambda: self.sync(iteration, local_loss)
        )
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return IterationResult(
            iteration=iteration,
            loss=stats.loss,
            grad_norm=stats.grad_norm,
            lr=stats.lr,
            tokens=self._tokens if self.ordered is not None else tokens * self.dp,
            doc_lengths=lengths,
            t_start=t0,
            t_end=time.time(),
        )
