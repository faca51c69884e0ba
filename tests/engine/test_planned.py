"""Plans the scheduler emits (`unbroken.plan`) run on the engine and match the reference.

Re-plans of small data-parallel jobs on 4 local gloo ranks, as the coordinator will run them
(issue 18); every plan keeps the micro-batch ownership (`PlannerConfig(ownership=False)`), as
today's engine requires:

- a TP-2 replica loses a device: the planner shrinks it to TP 1 (eq. 4) and moves work to the
  healthy replica; the engine reshards parameters and AdamW moments onto the new plan (the
  dead rank's state overwritten with NaN first: its shards come from the DP peer);
- a slow device in a pipeline: the planner moves layers off its stage (repartition, the same
  split in both replicas), and the engine reshards the moved layers;
- a slow device, repartition off: the planner migrates a whole micro-batch to the healthy
  replica (Algorithm 1's seed), and the plan's action lists (the planner's own 1F1B list
  schedule) run it.

Each ends at the reference's result. A TP group whose lost device has no DP peer is not
covered: its shards exist nowhere else (ResiHP Figure 8(b) falls back to persistent state).

Tolerances as in `test_worker_equivalence` (TP > 1 or migration: summation order changes).
"""

from __future__ import annotations

import pytest

from tests.engine.harness import Case, bit_equal, engine_job, reference, run_plans
from tests.engine.test_worker_equivalence import _assert_close
from unbroken.parallel import check_plan, make_plan, simulate
from unbroken.plan import ClusterState, Fabric, PlannerConfig, Workload, plan_for_state

WORKLOAD = Workload(
    num_layers=4,
    tokens=32,
    sum_sq=32.0**2,
    alpha_s=1e-3,
    beta_s=0.0,
    head_s=1e-3,
    message_bytes=32 * 64 * 4,
    layer_params=5e4,
    act_bytes_per_layer=1e5,
    reserved_bytes=0.0,
)
"""The engine's tiny model, priced in round numbers (4 layers, as `harness.ENGINE_MODEL`)."""
FABRIC = Fabric(gpus_per_node=8, intra_bytes_per_s=1e10, inter_bytes_per_s=1e9)
EXACT_DP = engine_job(grad_clip=0.0, microbatches=2)


def _planned(plan, change, config):
    cluster = change(ClusterState.healthy(plan, WORKLOAD, FABRIC, memory_bytes=1e9))
    result = plan_for_state(cluster, config)
    new = result.plan()
    assert check_plan(new) == [] and simulate(new, result.scorer.costs(result.layout)).ok
    return result, new


def _cases():
    old = make_plan(2, 1, 2, 4, 2)
    _, shrunk = _planned(old, lambda c: c.with_lost(1), PlannerConfig(ownership=False))
    assert shrunk.replicas[0].stages[0].ranks == (0,)
    assert shrunk.microbatches == (2, 2)
    piped = make_plan(2, 2, 1, 4, 2)
    _, split = _planned(piped, lambda c: c.with_slow(0, speed=0.25), PlannerConfig(ownership=False))
    assert [g.layers for g in split.replicas[0].stages] == [(0, 1), (1, 4)]
    config = PlannerConfig(ownership=False, repartition=False)
    _, migrated = _planned(piped, lambda c: c.with_slow(0, speed=0.25), config)
    assert migrated.migrations and migrated.microbatches == (2, 2)
    return [
        Case("planned-lost-device", old, EXACT_DP, iterations=1, dead=(1,), then=shrunk),
        Case("planned-repartition", piped, EXACT_DP, iterations=1, then=split),
        Case("planned-migration", migrated, EXACT_DP, iterations=1),
    ]


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    cases = _cases()
    return cases, run_plans(cases, 4, tmp_path_factory.mktemp("engine-planned"))


@pytest.mark.parametrize(
    ("name", "iterations"),
    [("planned-lost-device", 2), ("planned-repartition", 2), ("planned-migration", 1)],
)
def test_planned_plans_match_the_reference(outcomes, name, iterations):
    _, out = outcomes
    outcome = out[name]
    _assert_close(outcome, reference(EXACT_DP, 2, iterations), exact=False)
    assert bit_equal(outcome.params[0], outcome.params[1]), "replicas diverged"
