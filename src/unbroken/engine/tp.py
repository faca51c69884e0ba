"""Megatron-style tensor-parallel building blocks over an explicitly passed TP group.

Owns the communication in a TP-sharded stage (Megatron-LM `tensor_parallel/mappings.py`,
`layers.py`, `cross_entropy.py`):

- `copy_to_tp` (Megatron's *f*): identity forward, all-reduce of the gradient backward. It sits
  in front of column-parallel linears, once per consumer group (q/k/v share one, w1/w3 share one).
- `reduce_from_tp` (Megatron's *g*): all-reduce forward, identity backward, after row-parallel
  linears and the vocabulary-parallel embedding.
- `vocab_parallel_embedding`: each rank holds rows [lo, hi) of the table; tokens outside give
  zeros, the all-reduce completes the lookup.
- `vocab_parallel_cross_entropy`: per-token loss over logits sharded by vocabulary, with the
  max, the target logit and the softmax denominator all-reduced (three small all-reduces).

[Note: tp-degree-1] With a TP group of size 1 every function here is the plain torch op the
reference model uses (no masking, no extra arithmetic), so a TP=1 stage computes the same bits
as `unbroken.model.llama`.

Never holds a process group beyond the `TPGroup` value it is given; nothing module-global.
`TPGroup.clock` adds up the seconds its collectives took, so the worker can count them as time
blocked on peers (fail-slow localization inside a TP group, `unbroken.detect.timing`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from unbroken.data.packing import IGNORE_INDEX

__all__ = [
    "CollectiveClock",
    "TPGroup",
    "copy_to_tp",
    "masked_lookup",
    "reduce_from_tp",
    "shard_logits_grad",
    "shard_target",
    "token_mean",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_embedding",
]


@dataclass(slots=True)
class CollectiveClock:
    """Seconds spent in a group's collectives, added up by the caller that reads it.

    Host wall time around each call: with gloo (blocking) that is the collective, waiting for
    the last member included; with NCCL (asynchronous) it is only the time to enqueue it.
    """

    seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class TPGroup:
    """This rank's place in its stage's TP group.

    `group` may be None only when `size == 1` (or on the meta device, where nothing runs).
    """

    size: int = 1
    """TP degree of the stage."""
    rank: int = 0
    """Position of this rank in the group (TP order of the plan's `StageGroup.ranks`)."""
    group: dist.ProcessGroup | None = None
    """The process group of the stage's ranks."""
    clock: CollectiveClock = field(default_factory=CollectiveClock, compare=False, repr=False)
    """Seconds in `all_reduce` so far (the worker reads the difference per action)."""

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"TP position {self.rank} out of range for degree {self.size}")

    def shard(self, n: int, what: str) -> tuple[int, int]:
        """[lo, hi) of this rank's share of `n` items split evenly.

        Raises:
            ValueError: `n` is not divisible by the degree.
        """
        if n % self.size:
            raise ValueError(f"{what}={n} is not divisible by the TP degree {self.size}")
        per = n // self.size
        return self.rank * per, (self.rank + 1) * per

    def all_reduce(self, t: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> None:
        if self.size > 1:
            t0 = time.perf_counter()
            dist.all_reduce(t, op=op, group=self.group)
            self.clock.seconds += time.perf_counter() - t0


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
        ctx.tp = tp
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        ctx.tp.all_reduce(grad)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
        out = x.contiguous().clone()
        tp.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def copy_to_tp(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Identity forward; gradient all-reduced over the TP group backward."""
    return x if tp.size == 1 else _CopyToTP.apply(x, tp)


def reduce_from_tp(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """All-reduce (sum) over the TP group forward; identity backward."""
    return x if tp.size == 1 else _ReduceFromTP.apply(x, tp)


def vocab_parallel_embedding(
    tokens: torch.Tensor, weight: torch.Tensor, tp: TPGroup
) -> torch.Tensor:
    """Lookup in a table sharded by rows: `weight` holds rows [lo, lo + len(weight))."""
    if tp.size == 1:
        return F.embedding(tokens, weight)
    return reduce_from_tp(masked_lookup(tokens, weight, tp.rank * weight.shape[0]), tp)


def masked_lookup(tokens: torch.Tensor, weight: torch.Tensor, lo: int) -> torch.Tensor:
    """One TP position's part of a vocabulary-parallel lookup: rows [lo, lo + len(weight))
    of the table, zeros for tokens outside them (the all-reduce of the parts completes it)."""
    outside = (tokens < lo) | (tokens >= lo + weight.shape[0])
    local = torch.where(outside, 0, tokens - lo)
    return F.embedding(local, weight) * (~outside).unsqueeze(-1).to(weight.dtype)


class _VocabParallelCE(torch.autograd.Function):
    """Per-token cross-entropy over vocabulary-sharded logits (Megatron's
    `_VocabParallelCrossEntropy`); the backward is softmax minus one-hot, locally."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, tp: TPGroup) -> torch.Tensor:
        top = logits.max(dim=-1).values
        tp.all_reduce(top, dist.ReduceOp.MAX)
        shifted = logits - top.unsqueeze(-1)
        picked, outside, local = shard_target(shifted, targets, tp.rank * logits.shape[-1])
        tp.all_reduce(picked)
        exp = shifted.exp()
        denom = exp.sum(dim=-1)
        tp.all_reduce(denom)
        softmax = exp.div_(denom.unsqueeze(-1))
        ctx.save_for_backward(softmax, outside, local)
        return denom.log() - picked

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return shard_logits_grad(*ctx.saved_tensors, grad), None, None


def shard_target(
    shifted: torch.Tensor, targets: torch.Tensor, lo: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One vocabulary shard's (picked target logit or 0, targets outside it, local index)."""
    outside = (targets < lo) | (targets >= lo + shifted.shape[-1])
    local = torch.where(outside, 0, targets - lo)
    rows = torch.arange(shifted.shape[0], device=shifted.device)
    return torch.where(outside, 0.0, shifted[rows, local]), outside, local


def shard_logits_grad(
    softmax: torch.Tensor, outside: torch.Tensor, local: torch.Tensor, grad: torch.Tensor
) -> torch.Tensor:
    """One vocabulary shard's logits gradient: (softmax - one-hot) x the per-token gradient."""
    g = softmax.clone()
    rows = torch.arange(g.shape[0], device=g.device)
    g[rows, local] -= (~outside).to(g.dtype)
    return g * grad.unsqueeze(-1)


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, tp: TPGroup
) -> torch.Tensor:
    """Mean loss over the targets that are not `IGNORE_INDEX`, as the reference model's
    `F.cross_entropy(..., reduction="sum") / count` ([Note: tp-degree-1])."""
    if tp.size == 1:
        count = (targets != IGNORE_INDEX).sum().clamp(min=1)
        return F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum") / count
    return token_mean(_VocabParallelCE.apply(logits, targets, tp), targets)


def token_mean(per_token: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean of a per-token loss over the targets that are not `IGNORE_INDEX`."""
    count = (targets != IGNORE_INDEX).sum().clamp(min=1)
    valid = (targets != IGNORE_INDEX).to(per_token.dtype)
    return (per_token * valid).sum() / count
