"""A replica with no micro-batch ([Note: empty replica] in `unbroken.plan.balance`) and its
probe ([Note: probe micro-batch] in `unbroken.engine.probe`): the scheduler gives the slow
replica of a PP=2 x DP=2 job 0 micro-batches, and the engine runs that plan bit-exactly against
the launch plan, probing or not.

On 4 local gloo ranks (`parallel.reduce = "ordered"`, clipping on), from the same initial state
and data, 3 iterations each of:

- the launch plan (2 micro-batches per replica);
- the scheduler's plan for rank 3 at 1/20 speed: micro-batches [4, 0] — replica 1's ranks run
  REDUCE_GRAD and OPT_STEP only (no addend in the ordered fold, a full optimizer step) — with a
  probe micro-batch every iteration (`adapt.probe_every = 1`), and with none;
- 1 iteration on the launch plan, a live switch to [4, 0], 2 more (the re-plan);
- 1 iteration on [4, 0], a live switch back to the launch plan, 2 more (the re-admission).

Each must end with the launch plan's losses, gradient norms and parameters bit for bit, the
empty replica must hold the busy one's parameters (it stepped with the reduced gradient), and
the probing ranks must have timed the probe's forward and backward (the probe ran, so its
absence of effect is what the bit-exact check shows).
"""

from __future__ import annotations

import dataclasses

import pytest

from tests.engine.harness import Case, assert_same_run, bit_equal, engine_job, run_plans
from tests.engine.test_planned import FABRIC, WORKLOAD
from unbroken.config import AdaptConfig, ParallelConfig
from unbroken.parallel import check_plan, make_plan
from unbroken.plan import ClusterState, PlannerConfig, plan_for_state


def _cases():
    launch = make_plan(2, 2, 1, 4, 2)
    cluster = ClusterState.healthy(launch, WORKLOAD, FABRIC, memory_bytes=1e9)
    live = PlannerConfig(exclusion=False, repartition=False)
    empty = plan_for_state(cluster.with_slow(3, speed=0.05), live).plan()
    assert empty.microbatches == (4, 0) and not empty.migrations
    assert check_plan(empty) == []
    cfg = dataclasses.replace(
        engine_job(microbatches=2, grad_clip=0.05),
        parallel=ParallelConfig(world_size=4, pp=2, tp=1, reduce="ordered"),
    )
    probing = dataclasses.replace(cfg, adapt=AdaptConfig(probe_every=1))
    quiet = dataclasses.replace(cfg, adapt=AdaptConfig(probe_every=0))
    return [
        Case("launch", launch, cfg, iterations=3),
        Case("empty", empty, probing, iterations=3, shards=2),
        Case("empty-quiet", empty, quiet, iterations=3, shards=2),
        Case("to-empty", launch, probing, iterations=1, then=empty, after=2, switch=True),
        Case("back", empty, probing, iterations=1, then=launch, after=2, switch=True, shards=2),
    ]


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    return run_plans(_cases(), 4, tmp_path_factory.mktemp("engine-empty"))


@pytest.mark.parametrize("name", ["empty", "empty-quiet", "to-empty", "back"])
def test_a_plan_with_an_empty_replica_matches_the_launch_plan_bit_for_bit(outcomes, name):
    assert_same_run(outcomes["launch"], outcomes[name])


@pytest.mark.parametrize("name", ["empty", "empty-quiet"])
def test_the_empty_replica_steps_with_the_reduced_gradient(outcomes, name):
    got = outcomes[name]
    assert len(got.params) == 2 and bit_equal(got.params[0], got.params[1])


def test_only_the_empty_replica_probes_and_only_when_asked(outcomes):
    assert outcomes["empty"].probes == {0: 0, 1: 0, 2: 2, 3: 2}  # F and B on ranks 2 and 3
    assert outcomes["to-empty"].probes == {0: 0, 1: 0, 2: 2, 3: 2}
    assert set(outcomes["empty-quiet"].probes.values()) == {0}
    assert set(outcomes["back"].probes.values()) == {0}
