"""The scorer times a layout exactly as the simulator times its full plan ([Note: reduced
simulation]), and the lists it makes are coherent and cannot deadlock with blocking sends."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.plan.helpers import FABRIC, WORKLOAD, layout, state
from unbroken.parallel import Migration, Replica, StageGroup, check_plan, simulate, split_layers
from unbroken.plan import ClusterState, Layout, Scorer


@st.composite
def layouts(draw) -> tuple[Layout, ClusterState]:
    dp = draw(st.integers(1, 3))
    pp = draw(st.integers(1, 4))
    uniform = draw(st.booleans())
    next_rank, replicas = 0, []
    for _ in range(dp):
        split = (
            split_layers(8, pp)
            if uniform
            else split_layers(8, pp, draw(st.lists(st.integers(1, 4), min_size=pp, max_size=pp)))
        )
        edges = [sum(split[:k]) for k in range(pp + 1)]
        stages = []
        for s in range(pp):
            tp = draw(st.sampled_from((1, 2, 4)))
            stages.append(
                StageGroup(tuple(range(next_rank, next_rank + tp)), (edges[s], edges[s + 1]))
            )
            next_rank += tp
        replicas.append(Replica(tuple(stages)))
    counts = tuple(draw(st.integers(0, 5)) for _ in range(dp))  # 0: [Note: empty replica]
    counts = (max(counts[0], 1), *counts[1:]) if sum(counts) == 0 else counts
    skeleton = Layout(replicas=tuple(replicas), microbatches=counts).skeleton
    moves = {}
    for mb in range(sum(counts)):
        for s in range(pp):
            if dp > 1 and draw(st.integers(0, 4)) == 0:
                to = draw(st.integers(0, dp - 1))
                owner = skeleton.owner(mb)
                if (
                    to != owner
                    and replicas[to].stages[s].layers == replicas[owner].stages[s].layers
                ):
                    moves[(mb, s)] = Migration(mb, s, to)
    bounds = tuple(tuple(draw(st.integers(1, pp + 1)) for _ in range(pp)) for _ in range(dp))
    lay = Layout(
        replicas=tuple(replicas),
        microbatches=counts,
        migrations=tuple(moves.values()),
        inflight=bounds,
    )
    cluster = ClusterState.healthy(lay.skeleton, WORKLOAD, FABRIC, memory_bytes=1e12)
    for r in lay.ranks:
        if draw(st.integers(0, 5)) == 0:
            cluster = cluster.with_slow(r, speed=draw(st.sampled_from((0.25, 0.5, 0.8))))
        if draw(st.integers(0, 7)) == 0:
            cluster = cluster.with_slow(r, link_speed=draw(st.sampled_from((0.001, 0.05))))
    return lay, cluster


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layouts())
def test_reduced_time_equals_the_full_simulation(case):
    lay, cluster = case
    scorer = Scorer(cluster)
    plan = scorer.plan(lay)
    full = simulate(plan, scorer.costs(lay))  # blocking-send replay and static checks included
    assert full.ok, full.deadlocks[:3]
    assert check_plan(plan) == []
    assert scorer.time(lay) == pytest.approx(full.iteration_time, rel=1e-12)


def test_equal_replicas_are_simulated_once_and_cached():
    lay = layout(4, 2, 2, 4)
    scorer = Scorer(state(lay))
    t = scorer.time(lay)
    assert scorer.simulations == 1
    assert scorer.time(lay) == t
    assert scorer.simulations == 1


def test_a_bound_stops_at_the_first_component_reaching_it():
    lay = layout(2, 2, 1, 4)
    cluster = state(lay).with_slow(0, speed=0.25)
    scorer = Scorer(cluster)
    exact = scorer.time(lay)
    bounded = Scorer(cluster).time(lay, bound=0.0)
    assert bounded >= 0.0
    assert bounded == exact  # the slow replica is timed first, and it is the slowest


def test_traces_give_every_forward_and_backward_once():
    lay = layout(2, 3, 1, 4).with_migrations([Migration(0, 1, 1)])
    traces = Scorer(state(lay)).traces(lay)
    seen = sorted((m, s) for (d, s), tr in traces.items() for m, _, _ in tr.forwards)
    assert seen == sorted((m, s) for m in range(8) for s in range(3))
    for tr in traces.values():
        assert all(a <= b for _, a, b in tr.forwards)
        assert len(tr.forwards) == len(tr.backwards)


def test_a_slow_link_is_priced_on_its_chunk():
    lay = layout(2, 2, 4, 2)  # one node per stage: the boundary crosses the network
    cluster = state(lay)
    slow = cluster.with_slow(lay.group(0, 0).ranks[1], link_speed=0.01)
    a, b = lay.group(0, 0).ranks, lay.group(0, 1).ranks
    healthy_s = Scorer(cluster).message_s(a, b)
    slow_s = Scorer(slow).message_s(a, b)
    assert slow_s > 50 * healthy_s  # the slowed chunk dominates the message
    assert math.isfinite(slow_s)


def test_one_ranks_actions_match_the_full_plan():
    lay = layout(3, 2, 2, 4).with_migrations([Migration(0, 1, 1), Migration(5, 0, 2)])
    cluster = state(lay).with_slow(2, speed=0.5).with_slow(9, link_speed=0.01)
    scorer = Scorer(cluster)
    plan = scorer.plan(lay)
    for rank in lay.ranks:
        assert scorer.actions_of(lay, rank) == plan.actions[rank]
