"""Load a checkpoint saved under one parallel layout into a rank of another (issue 18 item 3,
issue 19: when every replica of a stage is lost, the newest checkpoint is loaded under the
smaller plan; the same holds for any plan change between the save and the load).

A checkpoint holds each rank's flat buffers under its own key (`rank{r}/params`, ... for a
plan's ranks; one replica's `params`, ... for a data-parallel job) and, since stop 31, its
*layout record* (`layout.json`, `unbroken.checkpoint.dcp.LAYOUT`): for every rank of one
complete replica, the layer ranges of its virtual stages and its tensor-parallel position;
or `{"kind": "replicated"}` for a data-parallel job (every rank holds the whole model). Two
records are equal exactly when the flat buffers are interchangeable, so a plan change that
only moves micro-batches keeps the fast path.

Loading under another layout (`load_resharded`): each source rank's flat buffers are read
whole from the checkpoint (no process group: every rank reads what it needs), cut into
parameters by that rank's `FlatLayout` (rebuilt on the meta device from the record, as the
rank built it), tensor-parallel shards concatenated (`unshard`), and this rank's shard of every
parameter it stores copied out with `load_from_full`, as a fresh rank loads its initial
parameters. Parameters and both moments are moved alike; gradients are not state.

Why by hand: DCP reshards named tensors (DTensor / ShardedTensor plans); our state is one flat
buffer per rank whose offsets depend on the stage's layers and TP position, so the mapping
from names to offsets is ours. Memory: a rank holds the full tensors of the parameters it
stores (three segments) while it loads — fine for a restart, not for a live re-plan, which
moves only the pieces (`unbroken.engine.reshard`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from unbroken.checkpoint import CheckpointInfo, check_seed, read_layout
from unbroken.config import JobConfig
from unbroken.engine.build import stage_layers
from unbroken.engine.sharding import load_from_full, unshard
from unbroken.engine.stage import StageModel
from unbroken.engine.tp import TPGroup
from unbroken.model import FlatLayout, build_model, resolve_args
from unbroken.model.meta import skip_meta_init
from unbroken.parallel import ParallelPlan
from unbroken.train.state import TrainState

__all__ = ["layout_record", "load_resharded", "rank_layout"]

_REPLICATED = {"kind": "replicated"}


def layout_record(plan: ParallelPlan | None) -> str:
    """The layout record of a job running `plan` (None: data-parallel), canonical JSON."""
    if plan is None:
        return json.dumps(_REPLICATED, sort_keys=True)
    ranks = {}
    for group in plan.replicas[0].stages[: plan.pp]:  # one replica: the others hold the same
        layers = [list(x) for x in stage_layers(plan, group.ranks[0])]
        for i, r in enumerate(group.ranks):
            ranks[str(r)] = {"layers": layers, "tp": len(group.ranks), "tp_rank": i}
    return json.dumps({"kind": "plan", "ranks": ranks}, sort_keys=True)


def rank_layout(
    cfg: JobConfig, entry: Mapping[str, Any] | None, search: Iterable[str] = ()
) -> FlatLayout:
    """The `FlatLayout` a rank builds for one entry of a layout record (None: the whole
    model, as a data-parallel replica builds it), on the meta device for the reference
    model."""
    search = list(search)
    if cfg.model.factory:
        from unbroken.engine.own_stages import factory_stage
        from unbroken.engine.replica import user_model

        if entry is None:
            return FlatLayout.of(user_model(cfg, search), no_decay=cfg.train.no_decay)
        model = factory_stage(cfg, [tuple(x) for x in entry["layers"]], search)
        return FlatLayout.of(model, no_decay=cfg.train.no_decay, tied=model.tied)
    args = resolve_args(cfg.model)
    if entry is None:
        return FlatLayout.of(build_model(args, "meta"), no_decay=cfg.train.no_decay, tied=args.tied)
    tp = TPGroup(entry["tp"], entry["tp_rank"])
    with skip_meta_init():
        model = StageModel(args, [tuple(x) for x in entry["layers"]], tp, device="meta")
    return FlatLayout.of(model, no_decay=cfg.train.no_decay, tied=model.tied)


def _read(info: CheckpointInfo, keys: list[str]) -> dict[str, torch.Tensor]:
    """Whole tensors of the checkpoint by key, sized from its metadata."""
    meta = dcp.FileSystemReader(str(info.path)).read_metadata().state_dict_metadata
    out = {}
    for k in keys:
        size = meta[k].size
        dtype = meta[k].properties.dtype
        out[k] = torch.empty(tuple(size), dtype=dtype)
    dcp.load(out, checkpoint_id=str(info.path), no_dist=True)
    return out


def _full_tensors(
    info: CheckpointInfo,
    record: Mapping[str, Any],
    cfg: JobConfig,
    segments: list[str],
    wanted: set[str],
    search: list[str],
) -> dict[str, dict[str, torch.Tensor]]:
    """segment -> parameter name -> full tensor, for the `wanted` names, from the source
    ranks of `record`."""
    if record["kind"] == "replicated":
        sources = [("", None)]
    else:
        ranks = sorted(record["ranks"].items(), key=lambda item: int(item[0]))
        sources = [(f"rank{r}/", e) for r, e in ranks]
    shards: dict[str, dict[str, dict[int, torch.Tensor]]] = {s: {} for s in segments}
    for prefix, entry in sources:
        layout = rank_layout(cfg, entry, search)
        names = [n for s in layout.stored for n in s.names if n in wanted]
        if not names:
            continue
        flat = _read(info, [prefix + s for s in segments])
        pos = entry["tp_rank"] if entry else 0
        for seg in segments:
            views = layout.views(flat[prefix + seg])
            for n in names:
                shards[seg].setdefault(n, {}).setdefault(pos, views[n])
    return {
        seg: {n: unshard(n, [by_pos[i] for i in sorted(by_pos)]) for n, by_pos in per.items()}
        for seg, per in shards.items()
    }


def load_resharded(
    info: CheckpointInfo,
    state: TrainState,
    layout: FlatLayout,
    tp: TPGroup,
    cfg: JobConfig,
    *,
    search: Iterable[str] = (),
) -> int:
    """Load `info`, saved under another layout, into this rank's `state` (`layout`, TP
    position `tp`); returns the next iteration to run. No collective.

    Raises:
        CheckpointMismatch: saved with another `train.seed`.
        ValueError: the checkpoint has no layout record, or misses a parameter this rank
            stores.
    """
    text = read_layout(info)
    if text is None:
        raise ValueError(f"{info.path}: no layout record to reshard from")
    scalars = _read(info, ["iteration", "rng_seed"])
    check_seed(info, int(scalars["rng_seed"]), cfg.train.seed)  # before reading the state
    segments = list(state.persistent())
    wanted = {s.name for s in layout.stored}
    full = _full_tensors(info, json.loads(text), cfg, segments, wanted, list(search))
    missing = wanted - set(full[segments[0]])
    if missing:
        raise ValueError(f"{info.path}: the checkpoint holds no {sorted(missing)}")
    targets = state.persistent()
    for seg in segments:
        host = torch.zeros(targets[seg].numel(), dtype=targets[seg].dtype)
        load_from_full(full[seg], layout, host, tp.size, tp.rank)
        targets[seg].copy_(host)
    return int(scalars["iteration"])
