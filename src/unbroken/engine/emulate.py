"""A TP-1 stage that computes as a wider TP group: the launch plan's bits on one device.

ResiHP §6.1 shrinks a TP group around a slow or lost device (TP 2 -> TP 1 on the survivor).
A real TP-1 stage computes other bits than the TP-2 stage it replaces: the row-parallel
linears' output is one GEMM instead of two partial GEMMs summed by the group's all-reduce, the
vocabulary-parallel loss one softmax instead of two shards' — so the job would drift from its
fault-free run by rounding, and its audit against the launch plan would fail.

Here the device that takes over a group's stage holds the whole tensors (the TP-1 layout: every
flat-state consumer — resharding, parity, the fine-shard reduction — sees an ordinary TP-1
stage) and computes them *as the group did*, position by position: position i's query heads
and kv-groups, FFN columns and vocabulary rows through the same GEMMs on the same shard shapes
(a column shard is a contiguous row range of the weight; a row-parallel shard is copied
contiguous, as a TP rank holds it), and the group's collectives become local folds of the
positions' parts — a sum for the all-reduce after wo / w2 / the embedding, the input
gradient's sum for `copy_to_tp`'s backward, max and sums for the vocabulary-parallel loss.

[Note: emulated sums] A TP group's all-reduce over 2 ranks is one addition, which commutes: the
local fold equals it bit for bit. Over more ranks the collective's own order (gloo's or NCCL's
algorithm) decides, and a left fold may differ from it; so exactness is claimed and tested at
degree 2 (`tests/engine/test_ordered_plans.py` "tp-excluded"), and the coordinator takes
a TP exclusion live only from a TP-2 group to TP 1 (`PipelineAdaptation`).

Cost: the stage does the group's whole compute on one device (as a real TP-1 stage would) in
smaller GEMMs, plus a copy of each row-parallel shard per forward. Used only under the ordered
reduction (`parallel.reduce = "ordered"`, implied by `adapt.enabled`), where bits matter.
Written here because no library computes a tensor-parallel layer's shards on one device in
the group's arithmetic order.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence

import torch

from unbroken.engine.tp import masked_lookup, shard_logits_grad, shard_target

__all__ = ["cols", "emulated_cross_entropy", "emulated_embedding", "fold", "fork", "rows"]


class _Fork(torch.autograd.Function):
    """Identity forward; backward hands the gradient through. One per emulated position, so
    that each position's uses of its input add up there first — in the position's own order —
    and the positions' sums then meet at the input, as `copy_to_tp`'s all-reduce adds them."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


def fork(x: torch.Tensor) -> torch.Tensor:
    """`copy_to_tp` of one emulated position."""
    return _Fork.apply(x)


def fold(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """The positions' parts summed in position order (the all-reduce; [Note: emulated sums])."""
    return functools.reduce(operator.add, parts)


def rows(w: torch.Tensor, i: int, t: int) -> torch.Tensor:
    """Position i of t's share of a tensor split by rows (a contiguous view)."""
    n = w.shape[0] // t
    return w.narrow(0, i * n, n)


def cols(w: torch.Tensor, i: int, t: int) -> torch.Tensor:
    """Position i of t's share of a weight split by input columns, contiguous as that
    position holds it (the copy's backward hands the gradient to the view)."""
    n = w.shape[1] // t
    return w.narrow(1, i * n, n).contiguous()


def emulated_embedding(tokens: torch.Tensor, weight: torch.Tensor, t: int) -> torch.Tensor:
    """`vocab_parallel_embedding` of a t-wide group on one device."""
    n = weight.shape[0] // t
    return fold([masked_lookup(tokens, rows(weight, i, t), i * n) for i in range(t)])


class _EmulatedCE(torch.autograd.Function):
    """`_VocabParallelCE` of a t-wide group on one device: the shards' max, target logit and
    softmax denominator folded in position order; the backward per shard, locally."""

    @staticmethod
    def forward(ctx, targets: torch.Tensor, *logits: torch.Tensor) -> torch.Tensor:
        top = functools.reduce(torch.maximum, [x.max(dim=-1).values for x in logits])
        shifted = [x - top.unsqueeze(-1) for x in logits]
        n = logits[0].shape[-1]
        picks = [shard_target(s, targets, i * n) for i, s in enumerate(shifted)]
        exps = [s.exp() for s in shifted]
        denom = fold([e.sum(dim=-1) for e in exps])
        saved = []
        for e, (_, outside, local) in zip(exps, picks, strict=True):
            saved += [e.div_(denom.unsqueeze(-1)), outside, local]
        ctx.save_for_backward(*saved)
        return denom.log() - fold([p for p, _, _ in picks])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        saved = ctx.saved_tensors
        grads = [shard_logits_grad(*saved[j : j + 3], grad) for j in range(0, len(saved), 3)]
        return None, *grads


def emulated_cross_entropy(logits: Sequence[torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
    """Per-token loss over the positions' vocabulary shards of the logits, in order."""
    return _EmulatedCE.apply(targets, *logits)
