"""The ordered reduction of a plan (`unbroken.engine.ordered_plan`): a PP x DP job's result
does not depend on which replica computed which micro-batch, or on how many replicas there are.

On 4 local gloo ranks, a PP=2 x DP=2 job (`parallel.reduce = "ordered"`, clipping on) runs 3
iterations; so do, from the same initial state and data:

- the scheduler's plan after a device of replica 1 is lost: replica 1 dissolved, replica 0
  computes all 4 micro-batches (ranks 2 and 3 are standbys that only join the sync);
- the same with the surviving replica on ranks 2 and 3 (replica 0's device lost);
- the scheduler's micro-batch migration around a slow device (DP migration at stage level);
- 1 iteration on the launch plan, then the scheduler's layer repartition (the moved layers
  resharded onto the new split), then 2 more;
- the same with the repartition of the slow replica alone (micro-batches re-owned [1, 3]):
  replicas with different layouts, folded per set of a parameter's holders;
- 1 iteration on the launch plan, then a live switch to the migration plan at the boundary
  (`switch_plan`: same state, new groups and action lists), then 2 more.

and a DP=2 x TP=2 job continues on either replica alone (`dissolve_replicas`: a TP group lost
a device). Every one ends with its launch plan's parameters and losses bit for bit — what lets a live
re-plan stay bit-exact against the fault-free run on the original plan (issue 18 item 4).
Without the ordered reduction the dissolved plan differs (the control case), so the check
can fail.
"""

from __future__ import annotations

import dataclasses

import pytest

from tests.engine.harness import Case, assert_same_run, bit_equal, engine_job, run_plans
from tests.engine.test_planned import FABRIC, WORKLOAD
from unbroken.config import ParallelConfig
from unbroken.parallel import check_plan, make_plan
from unbroken.plan import ClusterState, PlannerConfig, plan_for_state
from unbroken.plan.shrink import dissolve_replicas


def _job(reduce: str, pp: int = 2, tp: int = 1):
    cfg = engine_job(microbatches=2, grad_clip=0.05)
    parallel = ParallelConfig(world_size=4, pp=pp, tp=tp, reduce=reduce)
    return dataclasses.replace(cfg, parallel=parallel)


def _planned(plan, change, config=None):
    cluster = change(ClusterState.healthy(plan, WORKLOAD, FABRIC, memory_bytes=1e9))
    new = plan_for_state(cluster, config).plan()
    assert check_plan(new) == []
    return new


def _cases():
    launch = make_plan(2, 2, 1, 4, 2)
    dissolved = _planned(launch, lambda c: c.with_lost(2))
    assert dissolved.dp == 1 and dissolved.microbatches == (4,)
    assert dissolved.ranks == (0, 1)
    other = _planned(launch, lambda c: c.with_lost(1))
    assert other.ranks == (2, 3) and other.microbatches == (4,)
    slow = PlannerConfig(ownership=False, repartition=False)
    migrated = _planned(launch, lambda c: c.with_slow(0, speed=0.25), slow)
    assert migrated.migrations
    split = _planned(launch, lambda c: c.with_slow(0, speed=0.25), PlannerConfig(ownership=False))
    assert [g.layers for g in split.replicas[0].stages] == [(0, 1), (1, 4)]
    lone = _planned(launch, lambda c: c.with_slow(0, speed=0.25), PlannerConfig(exclusion=False))
    assert [[g.layers for g in rep.stages] for rep in lone.replicas] == [
        [(0, 1), (1, 4)],
        [(0, 2), (2, 4)],
    ]
    ordered, plain = _job("ordered"), _job("allreduce")
    tp_launch = make_plan(2, 1, 2, 4, 2)
    tp_ordered = _job("ordered", pp=1, tp=2)
    excluded = _planned(tp_launch, lambda c: c.with_slow(0, speed=0.25))
    assert [[(g.ranks, g.tp) for g in rep.stages] for rep in excluded.replicas] == [
        [((1,), 1)],
        [((2, 3), 2)],
    ]
    return [
        Case("tp-launch", tp_launch, tp_ordered, iterations=3),
        Case("tp-excluded", tp_launch, tp_ordered, iterations=1, then=excluded, after=2),
        Case("tp-dissolved", dissolve_replicas(tp_launch, {3}), tp_ordered, iterations=3, shards=2),
        Case("tp-dissolved-other", dissolve_replicas(tp_launch, {0}), tp_ordered, 3, shards=2),
        Case("launch", launch, ordered, iterations=3),
        Case("dissolved", dissolved, ordered, iterations=3, shards=2),
        Case("dissolved-other", other, ordered, iterations=3, shards=2),
        Case("migrated", migrated, ordered, iterations=3),
        Case("repartitioned", launch, ordered, iterations=1, then=split, after=2),
        Case("repartitioned-one", launch, ordered, iterations=1, then=lone, after=2),
        Case("switched", launch, ordered, iterations=1, then=migrated, after=2, switch=True),
        Case("launch-allreduce", launch, plain, iterations=3),
        Case("dissolved-allreduce", dissolved, plain, iterations=3, shards=2),
    ]


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    return run_plans(_cases(), 4, tmp_path_factory.mktemp("engine-ordered"))


@pytest.mark.parametrize(
    "name",
    ["dissolved", "dissolved-other", "migrated", "repartitioned", "repartitioned-one", "switched"],
)
def test_a_replanned_job_matches_the_launch_plan_bit_for_bit(outcomes, name):
    assert_same_run(outcomes["launch"], outcomes[name])


@pytest.mark.parametrize("name", ["tp-dissolved", "tp-dissolved-other", "tp-excluded"])
def test_a_tp_job_without_a_broken_replica_matches_its_launch_plan_bit_for_bit(outcomes, name):
    assert_same_run(outcomes["tp-launch"], outcomes[name])


def test_every_replica_of_the_launch_plan_holds_the_same_state(outcomes):
    launch = outcomes["launch"]
    assert len(launch.params) == 2 and bit_equal(launch.params[0], launch.params[1])


def test_without_the_ordered_reduction_the_dissolved_plan_drifts(outcomes):
    """The control: the all-reduce path sums in another order after the re-plan."""
    ref, got = outcomes["launch-allreduce"], outcomes["dissolved-allreduce"]
    assert not bit_equal(got.params[0], ref.params[0])
