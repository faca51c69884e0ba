"""`shrink_pipeline`: a single-replica TP-1 pipeline on fewer devices — even stages over ranks
0..n-1, the micro-batches and schedule kept (interleaving only where it still applies)."""

from __future__ import annotations

import pytest

from unbroken.parallel import make_plan
from unbroken.plan import NoPlanError
from unbroken.plan.shrink import shrink_pipeline


def _stages(plan):
    return [(g.ranks, g.layers) for g in plan.replicas[0].stages]


def test_one_survivor_runs_every_layer_with_the_same_microbatches_and_schedule():
    plan = shrink_pipeline(make_plan(1, 2, 1, 4, 6, "zb_h1"), 1)
    assert _stages(plan) == [((0,), (0, 4))]
    assert (plan.microbatches, plan.schedule, plan.dp) == ((6,), "zb_h1", 1)


def test_three_survivors_of_four_split_the_layers_evenly_over_ranks_0_to_2():
    plan = shrink_pipeline(make_plan(1, 4, 1, 8, 4), 3)
    assert [r for r, _ in _stages(plan)] == [(0,), (1,), (2,)]
    spans = [hi - lo for _, (lo, hi) in _stages(plan)]
    assert sum(spans) == 8 and max(spans) - min(spans) <= 1


def test_more_survivors_than_layers_leave_the_rest_as_standbys():
    plan = shrink_pipeline(make_plan(1, 4, 1, 4, 4), 3)
    assert len(plan.ranks) == 3
    plan = shrink_pipeline(make_plan(1, 2, 1, 2, 4), 1)
    assert len(plan.ranks) == 1


def test_interleaving_is_kept_where_it_applies_and_dropped_where_not():
    kept = shrink_pipeline(make_plan(1, 4, 1, 8, 4, "interleaved_1f1b", virtual_stages=2), 2)
    assert (kept.schedule, kept.virtual_stages, kept.pp) == ("interleaved_1f1b", 2, 2)
    one = shrink_pipeline(make_plan(1, 4, 1, 8, 4, "interleaved_1f1b", virtual_stages=2), 1)
    assert (one.schedule, one.virtual_stages, one.pp) == ("1f1b", 1, 1)


def test_replicas_that_lost_a_whole_stage_become_one_replica_with_every_microbatch():
    plan = shrink_pipeline(make_plan(2, 2, 1, 4, 3), 2)
    assert (plan.dp, plan.pp, plan.microbatches, plan.ranks) == (1, 2, (6,), (0, 1))


def test_a_tensor_parallel_pipeline_keeps_its_tp_degree_on_fewer_stages():
    plan = shrink_pipeline(make_plan(1, 2, 2, 4, 4), 3)  # TP 2 x PP 2 lost a device
    assert (plan.dp, plan.pp, plan.ranks, plan.microbatches) == (1, 1, (0, 1), (4,))
    assert [(g.ranks, g.layers) for g in plan.replicas[0].stages] == [((0, 1), (0, 4))]
    deep = shrink_pipeline(make_plan(1, 4, 2, 8, 4), 5)
    assert (deep.pp, deep.ranks) == (2, (0, 1, 2, 3))
    assert {g.tp for g in deep.replicas[0].stages} == {2}


def test_it_refuses_too_few_devices_for_the_tp_degree_mixed_degrees_and_an_empty_world():
    with pytest.raises(NoPlanError, match="fewer than the TP degree 2"):
        shrink_pipeline(make_plan(1, 2, 2, 4, 4), 1)
    # Unless the caller asks for a smaller degree (TP 2 -> 1 computes as TP 2: engine.emulate).
    one = shrink_pipeline(make_plan(1, 2, 2, 4, 4), 1, tp=1)
    assert (one.pp, one.ranks, [g.tp for g in one.replicas[0].stages]) == (1, (0,), [1])
    with pytest.raises(ValueError, match="one TP degree"):
        shrink_pipeline(make_plan(1, 2, [2, 1], 4, 4), 3)
    with pytest.raises(NoPlanError):
        shrink_pipeline(make_plan(1, 2, 1, 4, 4), 0)


def test_dissolving_drops_every_replica_with_a_lost_rank_and_keeps_the_others_ranks():
    from unbroken.plan.shrink import dissolve_replicas

    plan = dissolve_replicas(make_plan(3, 1, 2, 4, 2), lost={3})  # replica 1 = ranks 2, 3
    assert plan.ranks == (0, 1, 4, 5) and plan.microbatches == (3, 3)
    assert [g.tp for rep in plan.replicas for g in rep.stages] == [2, 2]
    with pytest.raises(NoPlanError):
        dissolve_replicas(make_plan(2, 2, 1, 4, 2), lost={0, 3})
