"""Step 1 (ResiHP §6.1): eq. 4 over powers of two, k_min from memory, node-local standbys,
rebuilt pipelines."""

from __future__ import annotations

import pytest

from tests.plan.helpers import GiB, layout, state
from unbroken.plan import NoPlanError, plan_for_state
from unbroken.plan.exclusion import exclude, select_subgroup


def test_a_lost_device_shrinks_its_group_to_the_largest_power_of_two():
    lay = layout(2, 2, 4, 4)
    cluster = state(lay).with_lost(1)
    ex = exclude(cluster, lay)
    assert ex.layout.group(0, 0).ranks == (0, 2)  # three left: k = 2 of the fastest, by rank
    assert ex.standbys == (3,)
    (sel,) = ex.selections
    assert [(c.k, c.score) for c in sel.candidates] == [(1, 1.0), (2, 2.0)]
    assert ex.layout.group(1, 0).ranks == lay.group(1, 0).ranks  # unaffected groups stay


def test_eq4_drops_a_slow_device_when_fewer_fast_ones_do_more():
    lay = layout(1, 2, 4, 4)
    cluster = state(lay).with_slow(2, speed=0.3)  # k=4: 4 * 0.3 = 1.2 < k=2: 2 * 1.0
    chosen, table = select_subgroup(cluster, [0, 1, 2, 3], (0, 4), 2, current=4)
    assert chosen == (0, 1)
    assert {c.k: round(c.score, 6) for c in table} == {1: 1.0, 2: 2.0, 4: 1.2}


def test_eq4_keeps_a_mildly_slow_device_and_ties_go_to_the_current_degree():
    lay = layout(1, 2, 4, 4)
    mild = state(lay).with_slow(2, speed=0.6)  # 4 * 0.6 = 2.4 > 2
    assert select_subgroup(mild, [0, 1, 2, 3], (0, 4), 2, current=4)[0] == (0, 1, 2, 3)
    tie = state(lay).with_slow(2, speed=0.5)  # 4 * 0.5 = 2 = 2 * 1: keep TP 4
    assert select_subgroup(tie, [0, 1, 2, 3], (0, 4), 2, current=4)[0] == (0, 1, 2, 3)


def test_k_min_comes_from_memory():
    lay = layout(1, 2, 2, 4)
    small = state(lay, memory=4 * GiB)  # 4 layers + embedding do not fit on one device
    chosen, table = select_subgroup(small.with_lost(1), [0], (0, 4), 2, current=2)
    assert chosen is None and table == ()
    big = state(lay, memory=40 * GiB)
    assert select_subgroup(big.with_lost(1), [0], (0, 4), 2, current=2)[0] == (0,)


def test_standbys_of_the_node_replace_a_later_failure():
    lay = layout(1, 2, 4, 4)
    first = exclude(state(lay).with_lost(1), lay)
    assert first.standbys == (3,)
    # a second failure in the same node's group: G' = {0, 2} + standby 3 -> k = 2 stays
    cluster = state(lay).with_lost(1, 2)
    second = exclude(cluster.with_plan(first.layout.skeleton), first.layout)
    assert second.layout.group(0, 0).ranks == (0, 3)
    assert second.standbys == ()


def test_replicas_broken_at_different_stages_are_rebuilt_into_one():
    lay = layout(2, 2, 4, 4)
    small = 2.5 * GiB  # every stage needs TP 4 here: a group that loses a device is lost
    cluster = state(lay, memory=small).with_lost(0, 12)  # replica 0 stage 0, replica 1 stage 1
    ex = exclude(cluster, lay)
    assert ex.layout.dp == 1
    assert ex.recombined == 1
    assert [g.ranks for g in ex.layout.replicas[0].stages] == [(4, 5, 6, 7), (8, 9, 10, 11)]
    assert ex.layout.microbatches == (8,)  # the global batch is kept


def test_survivors_of_a_broken_replica_become_a_narrower_pipeline():
    lay = layout(2, 2, 4, 4)
    cluster = state(lay).with_lost(0, 1, 2, 3)  # replica 0 loses its whole stage-0 group
    ex = exclude(cluster, lay)
    assert ex.layout.dp == 2
    rebuilt = ex.layout.replicas[1]
    assert [g.tp for g in rebuilt.stages] == [2, 2]
    assert {r for g in rebuilt.stages for r in g.ranks} == {8, 9, 10, 11}


def test_no_complete_pipeline_is_an_error():
    lay = layout(1, 2, 1, 4)
    with pytest.raises(NoPlanError, match="no complete pipeline"):
        plan_for_state(state(lay).with_lost(1))
