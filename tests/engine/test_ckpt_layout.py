"""A checkpoint saved by a real TP2 x PP2 job loads under other layouts (the whole model, PP2,
TP2) with every parameter and moment where the new layout needs it, and under its own layout
to the same bits as the plain load; a data-parallel job's loads under PP2; the checkpoint
policy takes that path when the layouts differ (`unbroken.engine.ckpt_layout`)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from unbroken.api import run_job
from unbroken.checkpoint import find_latest_valid, list_checkpoints, load_checkpoint, read_layout
from unbroken.checkpoint.policy import CheckpointPolicy
from unbroken.config import ParallelConfig
from unbroken.engine.build import full_initial_params, plan_from_config
from unbroken.engine.ckpt_layout import layout_record, load_resharded, rank_layout
from unbroken.engine.replica import state_geometry
from unbroken.engine.sharding import shard_of
from unbroken.engine.tp import TPGroup
from unbroken.train.state import TrainState

from ..foundation.conftest import tiny_job

SEGMENTS = ("params", "exp_avg", "exp_avg_sq")


def _cfg(world: int, tp: int, pp: int):
    cfg = tiny_job(world_size=world, iterations=5, interval=2)
    return dataclasses.replace(cfg, parallel=ParallelConfig(world_size=world, tp=tp, pp=pp))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The newest checkpoint of a TP2 x PP2 job after some training (moments non-zero)."""
    out = tmp_path_factory.mktemp("tp2pp2")
    cfg = _cfg(4, 2, 2)
    s = run_job(cfg, out, quiet=True)
    assert s["state"] == "done"
    info = find_latest_valid(next(p for p in out.rglob("checkpoints/*") if p.is_dir()))
    assert info is not None and info.iteration >= 2
    return cfg, info


def _state(layout, cfg) -> TrainState:
    """Buffers as a rank allocates them: padded to its geometry (`state_geometry`)."""
    return TrainState.allocate(layout, "cpu", state_geometry(cfg, layout.numel).padded_numel)


def _whole(cfg, info) -> dict[str, dict[str, torch.Tensor]]:
    """segment -> name -> full tensor, loaded into the whole model's layout."""
    layout = rank_layout(cfg, None)
    st = _state(layout, cfg)
    assert load_resharded(info, st, layout, TPGroup(), cfg) == info.iteration
    return {seg: layout.views(t) for seg, t in st.persistent().items()}


def test_the_checkpoint_records_the_layout_it_was_saved_under(saved):
    cfg, info = saved
    assert read_layout(info) == layout_record(plan_from_config(cfg))


def test_the_whole_model_from_the_first_checkpoint_is_the_initial_model(saved):
    """An independent check of the assembly (stage ranges, TP order, tied copies): the
    iteration-0 checkpoint, resharded into the whole model, is `full_initial_params`."""
    cfg, info = saved
    first = list_checkpoints(info.path.parent)[0]
    assert first.iteration == 0
    initial = full_initial_params(cfg)
    whole = _whole(cfg, first)
    assert set(initial) <= set(whole["params"])
    for name, value in initial.items():
        assert torch.equal(whole["params"][name], value), name
        assert not whole["exp_avg"][name].any()


def test_its_own_layout_resharded_gives_the_plain_loads_bits(saved):
    cfg, info = saved
    record = json.loads(read_layout(info))
    for r, entry in record["ranks"].items():
        layout = rank_layout(cfg, entry)
        a, b = _state(layout, cfg), _state(layout, cfg)
        load_checkpoint(info, a, group=None, shard=f"rank{r}")
        tp = TPGroup(entry["tp"], entry["tp_rank"])
        load_resharded(info, b, layout, tp, cfg)
        for seg in SEGMENTS:
            assert torch.equal(a.persistent()[seg], b.persistent()[seg]), (r, seg)
        assert a.params.abs().sum() > 0 and a.exp_avg_sq.abs().sum() > 0


@pytest.mark.parametrize(("tp", "pp"), [(1, 2), (2, 1)])
def test_another_plan_gets_each_parameters_shard_of_the_saved_state(saved, tp, pp):
    cfg, info = saved
    whole = _whole(cfg, info)
    target = _cfg(2, tp, pp)
    record = json.loads(layout_record(plan_from_config(target)))
    for entry in record["ranks"].values():
        layout = rank_layout(target, entry)
        st = _state(layout, target)
        tpg = TPGroup(entry["tp"], entry["tp_rank"])
        load_resharded(info, st, layout, tpg, target)
        for seg, flat in st.persistent().items():
            for slot in layout.stored:
                want = shard_of(whole[seg][slot.name], slot.name, tpg.size, tpg.rank)
                assert torch.equal(layout.views(flat)[slot.name], want), (entry, seg, slot.name)


def test_the_policy_reshards_when_the_layouts_differ_and_says_so(saved):
    cfg, info = saved
    layout = rank_layout(cfg, None)
    st = _state(layout, cfg)
    events = []
    policy = CheckpointPolicy(
        cfg.checkpoint,
        info.path.parent,
        iterations=5,
        board=None,
        rank=0,
        group=None,
        emit=lambda kind, **kw: events.append((kind, kw)),
        rng_seed=cfg.train.seed,
        layout=layout_record(None),
        reshard=lambda i: load_resharded(i, st, layout, TPGroup(), cfg),
    )
    assert policy.load_latest(st) == info.iteration
    ((kind, event),) = events
    assert kind == "checkpoint_loaded" and event["resharded"] is True
    whole = _whole(cfg, info)
    assert torch.equal(layout.views(st.params)["embed.weight"], whole["params"]["embed.weight"])


def test_a_data_parallel_checkpoint_loads_under_a_pipeline_plan(tmp_path):
    """The other direction: a replicated checkpoint (one replica's buffers, no rank keys) cut
    into PP2 stages; the reference is the plain load into the whole model."""
    cfg = tiny_job(world_size=2, iterations=3, interval=2)
    assert run_job(cfg, tmp_path, quiet=True)["state"] == "done"
    info = find_latest_valid(next(p for p in tmp_path.rglob("checkpoints/*") if p.is_dir()))
    assert info is not None and read_layout(info) == layout_record(None)
    whole_layout = rank_layout(cfg, None)
    whole = _state(whole_layout, cfg)
    load_checkpoint(info, whole, group=None)
    target = _cfg(2, 1, 2)
    record = json.loads(layout_record(plan_from_config(target)))
    for entry in record["ranks"].values():
        layout = rank_layout(target, entry)
        st = _state(layout, target)
        assert load_resharded(info, st, layout, TPGroup(), target) == info.iteration
        for seg, flat in st.persistent().items():
            want = whole_layout.views(whole.persistent()[seg])
            for slot in layout.stored:
                assert torch.equal(layout.views(flat)[slot.name], want[slot.name]), slot.name


def test_a_checkpoint_of_another_seed_is_refused(saved):
    from unbroken.checkpoint import CheckpointMismatch

    cfg, info = saved
    other = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, seed=cfg.train.seed + 1))
    layout = rank_layout(other, None)
    with pytest.raises(CheckpointMismatch, match=r"train\.seed"):
        load_resharded(info, _state(layout, other), layout, TPGroup(), other)
