"""Gradient averaging across replicas whose layouts differ (issue #5 item 6, ResiHP §6).

After a re-plan, replicas may hold the same layer with different TP degrees (one replica's
stage lost a device and runs at TP 1, another still at TP 2) or split the layers differently
between stages. The engine then averages each parameter's gradient at the granularity of the
finest shard: for a parameter split along a dimension with TP degrees t_d in the replicas, let
f = max t_d; *fine piece* j of f (a contiguous 1/f along the split dimension) lives in replica d
on TP position ``j * t_d // f`` of the stage that holds the layer, at offset ``j mod (f / t_d)``
pieces inside that rank's shard. The holders of piece j — one rank per replica — all-reduce it
and divide by the replica count. Pieces with the same holders travel in one buffer, one
all-reduce per distinct holder tuple (groups created once, in a fixed order, on every rank).

Replicated parameters (the norm weights) are reduced between TP position 0 of every replica and
then broadcast inside each replica's TP group, so every copy stays identical.

Every replica then holds the same averaged gradient for every element, and the same optimizer
step gives the same parameters — what the next iteration's forward needs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from unbroken.engine.sharding import split_dim
from unbroken.engine.tp import TPGroup
from unbroken.model import TransformerArgs, build_model
from unbroken.parallel import ParallelPlan

__all__ = ["FineShardSync", "holders"]


@dataclass(frozen=True, slots=True)
class _Piece:
    name: str
    dim: int | None
    """Split dimension, None for a whole (replicated) tensor."""
    start: int
    length: int


def _stage_of(plan: ParallelPlan, replica: int, name: str, n_layers: int):
    stages = plan.replicas[replica].stages
    if name.startswith("layers."):
        layer = int(name.split(".")[1])
        return next(g for g in stages if g.layers[0] <= layer < g.layers[1])
    if name.startswith("embed."):
        return next(g for g in stages if g.layers[0] == 0)
    return next(g for g in stages if g.layers[1] == n_layers)


def holders(
    plan: ParallelPlan, args: TransformerArgs
) -> dict[tuple[int, ...], dict[int, list[_Piece]]]:
    """holder ranks (one per replica) -> rank -> the pieces of its local tensors, in order."""
    shapes = {n: tuple(p.shape) for n, p in build_model(args, "meta").named_parameters()}
    out: dict[tuple[int, ...], dict[int, list[_Piece]]] = {}
    for name, shape in shapes.items():
        groups = [_stage_of(plan, d, name, args.n_layers) for d in range(plan.dp)]
        dim = split_dim(name)
        if dim is None:
            ranks = tuple(g.ranks[0] for g in groups)
            for r in ranks:
                out.setdefault(ranks, {}).setdefault(r, []).append(_Piece(name, None, 0, 0))
            continue
        f = max(g.tp for g in groups)
        length = shape[dim] // f
        for j in range(f):
            ranks = tuple(g.ranks[j * g.tp // f] for g in groups)
            for g, r in zip(groups, ranks, strict=True):
                start = (j % (f // g.tp)) * length
                out.setdefault(ranks, {}).setdefault(r, []).append(_Piece(name, dim, start, length))
    return out


@dataclass(slots=True)
class FineShardSync:
    """This rank's part of the fine-shard gradient average; `build` is collective."""

    dp: int
    tp: TPGroup
    reductions: list[tuple[tuple[int, ...], dist.ProcessGroup, list[_Piece]]] = field(
        default_factory=list
    )
    """Per holder tuple this rank is in (sorted): the holders, one per replica in replica
    order, their group and this rank's pieces."""
    replicated: list[str] = field(default_factory=list)

    @classmethod
    def build(
        cls, plan: ParallelPlan, args: TransformerArgs, world: dist.ProcessGroup, tp: TPGroup
    ) -> FineShardSync:
        rank = dist.get_rank(world)
        sync = cls(plan.dp, tp)
        for ranks, by_rank in sorted(holders(plan, args).items()):
            group = dist.new_group([dist.get_global_rank(world, r) for r in ranks])
            if rank in by_rank:
                sync.reductions.append((ranks, group, by_rank[rank]))
        if rank in plan.ranks:
            d, s = plan.locate(rank)
            layers = [g.layers for k, g in enumerate(plan.replicas[d].stages) if k % plan.pp == s]
            names = build_model(args, "meta").state_dict().keys()
            sync.replicated = [
                n for n in names if split_dim(n) is None and _held(n, layers, args.n_layers)
            ]
        return sync

    def reduce(self, grads: Mapping[str, torch.Tensor]) -> None:
        """Average `grads` (this rank's local gradient tensors by name) across replicas."""
        for _, group, pieces in self.reductions:
            views = [
                grads[p.name] if p.dim is None else grads[p.name].narrow(p.dim, p.start, p.length)
                for p in pieces
            ]
            buf = torch.cat([v.reshape(-1) for v in views])
            dist.all_reduce(buf, group=group)
            buf.div_(self.dp)
            offset = 0
            for v in views:
                v.copy_(buf[offset : offset + v.numel()].view_as(v))
                offset += v.numel()
        if self.tp.size > 1 and self.replicated:
            buf = torch.cat([grads[n].reshape(-1) for n in self.replicated])
            dist.broadcast(buf, group=self.tp.group, group_src=0)
            offset = 0
            for n in self.replicated:
                grads[n].copy_(buf[offset : offset + grads[n].numel()].view_as(grads[n]))
                offset += grads[n].numel()


def _held(name: str, layers: list[tuple[int, int]], n_layers: int) -> bool:
    if name.startswith("layers."):
        i = int(name.split(".")[1])
        return any(lo <= i < hi for lo, hi in layers)
    if name.startswith("embed."):
        return any(lo == 0 for lo, _ in layers)
    return any(hi == n_layers for _, hi in layers)
