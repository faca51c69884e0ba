"""A plan job's state hash is taken per parameter, whichever rank holds it
(`slot_digests`, `PlanExecutor.job_hash`): the same model state under PP2 and under one stage
gives the same merged digests, a changed bit changes them, and TP shards are keyed by their
position (so no shard hides behind another)."""

from __future__ import annotations

import json

from unbroken.engine.build import full_initial_params, plan_from_config
from unbroken.engine.ckpt_layout import layout_record, rank_layout
from unbroken.engine.sharding import load_from_full
from unbroken.train.digest import slot_digests
from unbroken.train.state import TrainState

from ..foundation.conftest import tiny_job


def _state(cfg, entry, full, tp=(1, 0)):
    layout = rank_layout(cfg, entry)
    state = TrainState.allocate(layout)
    load_from_full(full, layout, state.params, *tp)
    for t, scale in ((state.exp_avg, 0.5), (state.exp_avg_sq, 0.25)):  # non-zero moments
        load_from_full({k: v * scale for k, v in full.items()}, layout, t, *tp)
    return state


def _merged(digests):
    out = {}
    for d in digests:
        for k, v in d.items():
            out.setdefault(k, v)
    return out


def test_the_same_model_state_hashes_alike_under_pp2_and_one_stage():
    import dataclasses

    from unbroken.config import ParallelConfig

    cfg = tiny_job(world_size=2)
    full = full_initial_params(cfg)
    pp2 = dataclasses.replace(cfg, parallel=ParallelConfig(world_size=2, pp=2))
    record = json.loads(layout_record(plan_from_config(pp2)))["ranks"]
    stages = [_state(cfg, record[str(r)], full) for r in (0, 1)]
    whole = _state(cfg, {"layers": [[0, 2]], "tp": 1, "tp_rank": 0}, full)
    split = _merged(slot_digests(s) for s in stages)
    assert split == slot_digests(whole)
    assert len(split) == len(whole.layout.slots)  # the tied head's copy is not counted twice
    stages[1].exp_avg_sq[0] += 1.0  # one moment's bit on the last stage
    assert _merged(slot_digests(s) for s in stages) != split


def test_tp_shards_are_keyed_by_their_position():
    cfg = tiny_job(world_size=2)
    full = full_initial_params(cfg)
    entry = {"layers": [[0, 2]], "tp": 2}
    shards = [
        slot_digests(_state(cfg, {**entry, "tp_rank": i}, full, (2, i)), f"@tp{i}/2")
        for i in (0, 1)
    ]
    assert not set(shards[0]) & set(shards[1])
    assert len(_merged(shards)) == len(shards[0]) * 2
