"""Tied embedding and head across pipeline stages: one parameter, two holders.

With `TransformerArgs.tie_embeddings` the token embedding and the output head are one weight
(an own model's stages name theirs in `tied`, e.g. a Hugging Face Qwen2's
``hf.model.embed_tokens.weight`` and ``hf.lm_head.weight``; `unbroken.engine.own_stages`).
A rank that runs both the first and the last layer holds it once under both names ([Note:
shared parameters] in `unbroken.model.flat`). On a pipeline they are on different ranks: the
first stage owns ``embed.weight`` and the last stage holds a copy, ``head.weight`` (a
`FlatLayout` copy: stored, updated and protected there, left out of the global gradient norm).
As Megatron's embedding group does, the two gradients are summed between the two holders of
each TP position of each replica after the data-parallel average, so both copies take the same
update from the same initial value and stay equal — the single-process model's one parameter,
whose gradient autograd sums over both uses.

The sum runs inside the gradient reduction of the compute phase (the `PlanGroups.fine` slot the
worker calls at REDUCE_GRAD), so a failure before it redoes the iteration and a failure after
it finds the summed gradients protected, as for any gradient.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from unbroken.model.llama import TIED_EMBEDDINGS
from unbroken.parallel import ParallelPlan

__all__ = ["TiedGradReduction", "embedding_pairs"]

_REDUCE_BUCKET = 1 << 25
"""Elements per data-parallel all-reduce (the worker's own bucket size)."""


def embedding_pairs(
    plan: ParallelPlan, names: tuple[str, str] = TIED_EMBEDDINGS
) -> list[tuple[tuple[int, int], tuple[str, str]]]:
    """The (first-stage rank, last-stage rank) pairs that hold the two copies of a tied
    embedding, one per replica and TP position, in a fixed order, with the name each holds
    (`names`: the first stage's, then the last stage's; the reference model's by default, an
    own model's stage `tied` group otherwise). Empty when every replica's first and last
    layers are on the same ranks.

    Raises:
        ValueError: the first and last stage of a replica have different TP degrees (their
            shards would not line up).
    """
    pairs = []
    for d, rep in enumerate(plan.replicas):
        first, last = rep.stages[0], rep.stages[-1]
        if first.ranks == last.ranks:
            continue
        if first.tp != last.tp:
            raise ValueError(
                f"replica {d}: tied embeddings need the first and last stage at one TP degree "
                f"(got {first.tp} and {last.tp})"
            )
        for a, b in zip(first.ranks, last.ranks, strict=True):
            pairs.append(((a, b), names))
    return pairs


@dataclass(slots=True)
class TiedGradReduction:
    """This rank's gradient reduction when it holds one copy of a tied embedding: the
    data-parallel average of its whole flat gradient (as the worker's own), then the sum of
    its copy's gradient with the other holder's.

    Args:
        grads: the rank's flat gradient buffer.
        dp: its data-parallel group (None or size 1: no average).
        dp_size: replicas averaged over.
        tie: the two-rank group of this copy's holders.
        name: the name this rank holds the copy under (``embed.weight`` or ``head.weight``).
    """

    grads: torch.Tensor
    dp: dist.ProcessGroup | None
    dp_size: int
    tie: dist.ProcessGroup
    name: str

    def reduce(self, views: Mapping[str, torch.Tensor]) -> None:
        """Average over replicas, then sum the tied copies (`views`: this rank's gradients by
        name, views of `grads`)."""
        if self.dp is not None and self.dp_size > 1:
            for a in range(0, self.grads.numel(), _REDUCE_BUCKET):
                dist.all_reduce(self.grads[a : a + _REDUCE_BUCKET], group=self.dp)
            self.grads.div_(self.dp_size)
        dist.all_reduce(views[self.name], group=self.tie)
