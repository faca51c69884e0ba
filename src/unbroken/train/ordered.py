"""A data-parallel iteration whose result does not depend on who computed what.

[Note: ordered reduction] gloo's float32 all-reduce sums in an order that changes with the
world size and the placement (PLATFORM-FACTS), and a replica that accumulates its
micro-batches' gradients into one buffer fixes their grouping. So a job that moves
micro-batches between ranks, or continues on fewer ranks after a device is lost (issue 18),
would drift from a fault-free run by rounding. Here every logical micro-batch k (global id,
`unbroken.parallel.DataPlacement`) is computed alone: its gradient G_k is the backward of its
loss / M into zeroed gradient buffers, kept aside. The global gradient is

    g = (((0 + G_0) + G_1) + ... + G_{S·M-1}) / S

summed elementwise in id order by whichever rank owns that slice of the flat buffer: one
`all_to_all` sends every rank's G_k slices to their owners, each owner folds its slice in id
order, one `all_gather` puts the slices together on every rank. The loss is the same fold over
the per-micro-batch losses (all-reduced as a vector with one non-zero per slot: adding zeros
is exact). Nothing in it depends on the world size, the rank a micro-batch ran on or the order
a rank computed its micro-batches, so any placement — the fault-free one included — gives the
same bits, and a re-planned run is bit-exact against the original fixed-plan reference.

Costs over the plain path: a copy of the gradient per local micro-batch (memory: one flat
gradient per micro-batch this rank computes) and an all-to-all of those copies instead of a
ring all-reduce. What it must never do: read the rank's identity into the arithmetic.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.distributed as dist

from unbroken.train.phases import Phase, PhaseHook

__all__ = ["OrderedGradients", "Placement"]


class Placement(Protocol):
    """What the ordered path needs of a placement (`unbroken.parallel.DataPlacement`)."""

    shards: int
    microbatches: int
    items: tuple[tuple[int, ...], ...]

    @property
    def total(self) -> int: ...

    def key(self, item: int) -> tuple[int, int]: ...


class OrderedGradients:
    """This rank's part of the ordered reduction for one placement.

    Args:
        grads: the flat gradient buffer (backward writes there; the result lands there).
        placement: who computes which micro-batch.
        rank: this rank in the placement's world.
        group: the world's process group (None: one process).
    """

    def __init__(
        self, grads: torch.Tensor, placement: Placement, rank: int, group: dist.ProcessGroup | None
    ) -> None:
        self.grads, self.placement, self.rank, self.group = grads, placement, rank, group
        self.world = len(placement.items)
        self.items: tuple[int, ...] = placement.items[rank]
        self.chunk = math.ceil(grads.numel() / self.world)
        width = self.chunk * self.world
        self.kept = torch.zeros((len(self.items), width), dtype=grads.dtype, device=grads.device)
        """Row j: the gradient of this rank's j-th micro-batch (zero-padded to `width`)."""
        self.losses = torch.zeros(2 * placement.total, dtype=torch.float64, device=grads.device)
        """Per global id: loss / M, then tokens (the sync all-reduces it)."""
        owners = {k: (r, j) for r, ids in enumerate(placement.items) for j, k in enumerate(ids)}
        offsets = [sum(len(ids) for ids in placement.items[:r]) for r in range(self.world)]
        self.order = [offsets[owners[k][0]] + owners[k][1] for k in range(placement.total)]
        """Per global id, in id order, its row in what the all-to-all delivers."""

    def keep(self, j: int, loss: torch.Tensor | None = None, tokens: int = 0) -> None:
        """After the backward of this rank's j-th micro-batch: set its gradient aside (the
        buffer is zeroed for the next one) and note its loss and tokens (None: the caller
        folds the loss itself, as a pipeline's last stage does)."""
        k = self.items[j]
        n = self.grads.numel()
        self.kept[j, :n].copy_(self.grads)
        self.grads.zero_()
        if loss is not None:
            self.losses[k] = loss.detach().double()
            self.losses[self.placement.total + k] = float(tokens)

    def reduce(self, hook: PhaseHook, iteration: int) -> None:
        """The global gradient into `grads` (collective; compute phase): ALLREDUCE 0 before
        the all-to-all, ALLREDUCE 1 before the all-gather, REDUCED after."""
        c, world = self.chunk, self.world
        hook(Phase.ALLREDUCE, iteration, 0, 2)
        if self.group is None or world == 1:
            received = self.kept  # one rank: its rows are every micro-batch, whole
        else:
            send = self.kept.view(len(self.items), world, c).transpose(0, 1).contiguous()
            counts = [len(ids) for ids in self.placement.items]
            received = torch.empty((sum(counts), c), dtype=self.grads.dtype, device=send.device)
            dist.all_to_all_single(
                received,
                send.view(-1, c),
                counts,  # rows: every micro-batch of every rank, one slice each
                [len(self.items)] * world,
                group=self.group,
            )
        mine = torch.zeros(c, dtype=self.grads.dtype, device=self.grads.device)
        for row in self.order:  # id order: the fold every placement shares
            mine += received[row]
        mine.div_(self.placement.shards)
        hook(Phase.ALLREDUCE, iteration, 1, 2)
        self._gather(mine)
        hook(Phase.REDUCED, iteration, 0, 1)

    def _gather(self, mine: torch.Tensor) -> None:
        n, c = self.grads.numel(), self.chunk
        if self.group is None or self.world == 1:
            self.grads.copy_(mine[:n])
            return
        out = torch.empty(c * self.world, dtype=mine.dtype, device=mine.device)
        dist.all_gather(list(out.split(c)), mine, group=self.group)
        self.grads.copy_(out[:n])

    def sync_stats(self) -> tuple[float, int]:
        """The job's loss (the fold of every micro-batch's loss / M, over S) and tokens
        (collective: the global synchronization of the sync phase)."""
        stats = self.losses
        if self.group is not None and self.world > 1:
            stats = stats.clone()
            dist.all_reduce(stats, group=self.group)
        values = stats.cpu().tolist()
        total = self.placement.total
        loss = 0.0
        for k in range(total):
            loss += values[k]
        return loss / self.placement.shards, int(sum(values[total:]))
