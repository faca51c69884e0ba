"""Properties of every plan the planner emits, over random cluster states (hypothesis): it fits
in memory, runs every stage of every micro-batch exactly once, uses no lost device, is never
predicted slower than the running plan, and is valid IR that the simulator runs to completion
(static checks and the blocking-send deadlock check included)."""

from __future__ import annotations

import math
from collections import defaultdict

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.plan.helpers import GiB, layout, state
from unbroken.parallel import ActionKind, check_plan, simulate
from unbroken.plan import NoPlanError, PlannerConfig, plan_for_state
from unbroken.plan.memory import memory_problems, need


@st.composite
def cluster_states(draw):
    dp, pp = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    tp = draw(st.sampled_from((1, 2, 4)))
    lay = layout(dp, pp, tp, draw(st.integers(pp, 6)))
    roomy = draw(st.booleans())
    peak = max(need_of(lay, d, s) for d in range(dp) for s in range(pp))
    memory = 40 * GiB if roomy else peak * draw(st.sampled_from((1.0, 1.3, 2.0)))
    cluster = state(lay, memory=memory, spare=draw(st.integers(0, 4)))
    for r in lay.ranks:
        roll = draw(st.integers(0, 19))
        if roll < 3:
            cluster = cluster.with_lost(r)
        elif roll < 6:
            cluster = cluster.with_slow(r, speed=draw(st.sampled_from((0.2, 0.5, 0.9))))
        elif roll < 8:
            cluster = cluster.with_slow(r, link_speed=draw(st.sampled_from((0.002, 0.1))))
    return cluster, lay


def need_of(lay, d, s):
    from tests.plan.helpers import WORKLOAD

    g = lay.group(d, s)
    return WORKLOAD.device_bytes(g.layers, g.tp, lay.inflight[d][s])


def rep_ranks(lay, d):
    return [r for g in lay.replicas[d].stages for r in g.ranks]


def _inflight(actions) -> int:
    live = most = 0
    for a in actions:
        if a.kind is ActionKind.F:
            live += 1
            most = max(most, live)
        elif a.kind is ActionKind.B:
            live -= 1
    return most


def _check(cluster, lay, config):
    try:
        result = plan_for_state(cluster, config, current=lay)
    except NoPlanError:
        # a replica without a lost device always survives (its groups keep a degree that fit)
        assert all(set(rep_ranks(lay, d)) & cluster.lost for d in range(lay.dp))
        return
    new, plan = result.layout, result.plan()
    # no lost device
    assert not set(new.ranks) & cluster.lost
    # memory: every group's devices hold its state and its in-flight activations ...
    assert memory_problems(cluster, new) == []
    for (d, s), g in new.groups():
        for r in g.ranks:
            assert _inflight(plan.actions[r]) <= new.inflight[d][s]  # ... which the lists obey
            assert (
                need(cluster, g.layers, g.tp, new.inflight[d][s]) <= cluster.device(r).memory_bytes
            )
    # every (micro-batch, stage) runs exactly once, on its placement's whole group
    runs = defaultdict(set)
    for rank, acts in plan.actions.items():
        for a in acts:
            if a.kind in (ActionKind.F, ActionKind.B):
                runs[(a.kind, a.microbatch, a.stage)].add(plan.locate(rank))
    total = sum(lay.microbatches)
    assert plan.total_microbatches == total
    for mb in range(total):
        for k in range(new.pp):
            for kind in (ActionKind.F, ActionKind.B):
                assert runs[(kind, mb, k)] == {(plan.executor(mb, k), k)}
    # never predicted slower than the running plan
    if math.isfinite(result.current_s):
        assert result.predicted_s <= result.current_s
    # valid IR, runs to completion with eager and with blocking sends; the prediction is its time
    assert check_plan(plan) == []
    timeline = simulate(plan, result.scorer.costs(new))
    assert timeline.ok, timeline.deadlocks[:3]
    assert result.predicted_s == pytest.approx(timeline.iteration_time, rel=1e-9)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cluster_states())
def test_every_plan_is_feasible_complete_and_no_slower(case):
    cluster, lay = case
    _check(cluster, lay, PlannerConfig())


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cluster_states())
def test_engine_compatible_plans_keep_ownership(case):
    cluster, lay = case
    _check(cluster, lay, PlannerConfig(ownership=False))
    try:
        result = plan_for_state(cluster, PlannerConfig(ownership=False), current=lay)
    except NoPlanError:
        return
    if result.layout.dp == lay.dp:
        assert result.layout.microbatches == lay.microbatches


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_plans_stay_feasible_over_a_sequence_of_failures(data):
    """Re-planning from the planner's own last layout (per-replica splits, re-owned batches,
    deeper bounds) after each new failure keeps every plan feasible."""
    from unbroken.plan.baselines import ResiHP

    dp, pp = data.draw(st.integers(2, 3)), data.draw(st.integers(2, 3))
    lay = layout(dp, pp, 4, 2 * pp)
    peak = max(need_of(lay, d, s) for d in range(dp) for s in range(pp))
    cluster = state(lay, memory=peak * data.draw(st.sampled_from((1.0, 1.5, 3.0))))
    policy = ResiHP(lay)
    order = data.draw(st.permutations(list(lay.ranks)))
    for rank in order[: data.draw(st.integers(1, 6))]:
        if data.draw(st.booleans()):
            cluster = cluster.with_lost(rank)
        else:
            cluster = cluster.with_slow(rank, speed=data.draw(st.sampled_from((0.2, 0.5))))
        out = policy.react(cluster)
        if not out.survived:
            return
        (new,) = out.layouts
        assert not set(new.ranks) & cluster.lost
        assert memory_problems(cluster, new) == []
        assert sum(new.microbatches) == sum(lay.microbatches)
