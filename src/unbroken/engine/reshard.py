"""Move model state from one plan's layout to another's (issue #5 item 7, ResiHP §6).

`reshard` is the re-planning primitive: after the planner emits a new plan (layers moved between
stages, a layer's TP degree changed from a to b, replicas re-formed around failed ranks), every
rank calls it with its tensors under the old plan and its freshly allocated tensors under the
new one, and parameters *and* optimizer moments arrive where the new plan needs them. Gradients
are not moved (a re-plan happens at an iteration boundary).

Routing works at the finest shard, as `dp_sync` does: for a parameter split with old degree t and
new degree t', f = max(t, t') pieces of 1/f each; the new holder at position i needs pieces
[i·f/t', (i+1)·f/t'), each held by old position j·t/f of the source replica. The source replica
of new replica d is old replica d when all its holders are alive, else the first replica whose
holders are (replicas hold identical state after a step, so any will do; that is what lets a
failed rank's state come from its DP peer). Pieces between the same two ranks travel as one
message; a rank's pieces to itself are copied locally. Every rank derives the same routing table
from the two plans, so one `batch_isend_irecv` on the world group moves everything.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from unbroken.engine.sharding import split_dim
from unbroken.model import TransformerArgs, build_model
from unbroken.parallel import ParallelPlan, StageGroup

__all__ = ["Route", "reshard", "routes"]

Tensors = Mapping[str, Mapping[str, torch.Tensor]]
"""segment ("params", "exp_avg", "exp_avg_sq") -> parameter name -> this rank's local tensor."""


@dataclass(frozen=True, slots=True)
class Route:
    """One piece of one parameter: from `src` (old plan) to `dst` (new plan)."""

    name: str
    src: int
    dst: int
    dim: int | None
    src_start: int
    dst_start: int
    length: int


def _holder(plan: ParallelPlan, replica: int, name: str, n_layers: int) -> StageGroup:
    stages = plan.replicas[replica].stages
    if name.startswith("layers."):
        layer = int(name.split(".")[1])
        return next(g for g in stages if g.layers[0] <= layer < g.layers[1])
    if name.startswith("embed."):
        return next(g for g in stages if g.layers[0] == 0)
    return next(g for g in stages if g.layers[1] == n_layers)


def routes(
    old: ParallelPlan,
    new: ParallelPlan,
    args: TransformerArgs,
    alive: Collection[int] | None = None,
) -> list[Route]:
    """The routing table, identical on every rank.

    Raises:
        ValueError: a parameter has no replica in `old` whose holders are all alive.
    """
    live = set(old.ranks if alive is None else alive)
    # Every name, tied ones included: a tied head on a last stage is a copy the new plan's
    # last stage needs (a rank holding both names receives the same values twice).
    model = build_model(args, "meta")
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters(remove_duplicate=False)}
    out = []
    for name, shape in shapes.items():
        dim = split_dim(name)
        for d in range(new.dp):
            dst_group = _holder(new, d, name, args.n_layers)
            candidates = ([d] if d < old.dp else []) + list(range(old.dp))
            src_group = next(
                (
                    g
                    for g in (_holder(old, c, name, args.n_layers) for c in candidates)
                    if set(g.ranks) <= live
                ),
                None,
            )
            if src_group is None:
                raise ValueError(f"{name}: every replica of the old plan lost a holder")
            if dim is None:  # replicated: every new position gets a whole copy
                src = src_group.ranks[0]
                for dst in dst_group.ranks:
                    out.append(Route(name, src, dst, None, 0, 0, 0))
                continue
            t, t_new = src_group.tp, dst_group.tp
            f = max(t, t_new)
            length = shape[dim] // f
            for j in range(f):
                out.append(
                    Route(
                        name,
                        src_group.ranks[j * t // f],
                        dst_group.ranks[j * t_new // f],
                        dim,
                        (j % (f // t)) * length,
                        (j % (f // t_new)) * length,
                        length,
                    )
                )
    return out


def _piece(tensors: Mapping[str, torch.Tensor], r: Route, start: int) -> torch.Tensor:
    t = tensors[r.name]
    return t if r.dim is None else t.narrow(r.dim, start, r.length)


# Long: an 11-line docstring and a 9-line signature; the body is 41 lines.
def reshard(
    old: ParallelPlan,
    new: ParallelPlan,
    args: TransformerArgs,
    world: dist.ProcessGroup,
    old_tensors: Tensors,
    new_tensors: Tensors,
    alive: Collection[int] | None = None,
) -> int:
    """Fill this rank's `new_tensors` from the ranks holding them under `old`; collective over
    `world` (ranks with nothing to send or receive return at once). Returns the bytes this
    rank received from other ranks (its own pieces are copied locally, not counted).

    Args:
        old, new: the plans before and after.
        args: the model's sizes.
        world: the group both plans number their ranks in.
        old_tensors: this rank's tensors under `old` by segment and name (empty if it held none).
        new_tensors: this rank's freshly allocated tensors under `new` (empty if it holds none).
        alive: ranks of `old` that still hold their state (default: all).
    """
    rank = dist.get_rank(world)
    table = routes(old, new, args, alive)
    segments = sorted(new_tensors or old_tensors)
    outgoing: dict[int, list[Route]] = {}
    incoming: dict[int, list[Route]] = {}
    for r in table:
        if r.src == rank:
            outgoing.setdefault(r.dst, []).append(r)
        if r.dst == rank:
            incoming.setdefault(r.src, []).append(r)
    incoming.pop(rank, None)  # a rank's pieces to itself: copied below
    with torch.no_grad():
        for r in outgoing.pop(rank, []):
            for seg in segments:
                _piece(new_tensors[seg], r, r.dst_start).copy_(
                    _piece(old_tensors[seg], r, r.src_start)
                )
        ops, unpack = [], []
        for dst, rs in sorted(outgoing.items()):
            buf = torch.cat(
                [
                    _piece(old_tensors[seg], r, r.src_start).reshape(-1)
                    for seg in segments
                    for r in rs
                ]
            )
            ops.append(dist.P2POp(dist.isend, buf, group=world, group_peer=dst))
        for src, rs in sorted(incoming.items()):
            views = [_piece(new_tensors[seg], r, r.dst_start) for seg in segments for r in rs]
            buf = torch.empty(
                sum(v.numel() for v in views), dtype=views[0].dtype, device=views[0].device
            )
            ops.append(dist.P2POp(dist.irecv, buf, group=world, group_peer=src))
            unpack.append((buf, views))
        if ops:
            for req in dist.batch_isend_irecv(ops):
                req.wait()
        for buf, views in unpack:
            offset = 0
            for v in views:
                v.copy_(buf[offset : offset + v.numel()].view_as(v))
                offset += v.numel()
    return sum(buf.numel() * buf.element_size() for buf, _ in unpack)
