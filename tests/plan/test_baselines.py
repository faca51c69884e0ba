"""The baselines do what their papers say, over the same simulator."""

from __future__ import annotations

import math

from tests.plan.helpers import GiB, layout, state
from unbroken.plan.baselines import (
    Adaptra,
    Greyhound,
    NoMitigation,
    Oobleck,
    ReCycle,
    ResiHP,
    recycle_layout,
    template_split,
)


def test_no_mitigation_and_the_fail_slow_baselines_stop_at_a_lost_device():
    lay = layout(2, 2, 2, 4)
    lost = state(lay).with_lost(3)
    for policy in (NoMitigation(lay), Greyhound(lay), Adaptra(lay)):
        out = policy.react(lost)
        assert not out.survived and out.reason


def test_greyhound_gives_the_slow_replica_fewer_micro_batches():
    lay = layout(2, 2, 1, 8)
    slow = state(lay).with_slow(lay.group(0, 1).ranks[0], speed=0.5)
    out = Greyhound(lay).react(slow)
    (new,) = out.layouts
    assert new.microbatches[0] < new.microbatches[1] and sum(new.microbatches) == 16
    assert out.time_s < NoMitigation(lay).react(slow).time_s


def test_greyhound_moves_layers_away_from_a_slow_link_stage():
    lay = layout(2, 3, 4, 6, layers=12)  # one node per stage
    cluster = state(lay)
    slow = cluster.with_slow(lay.group(0, 2).ranks[0], link_speed=0.01)
    (new,) = Greyhound(lay).react(slow).layouts
    assert new.split(0)[2] < 4


def test_recycle_reroutes_a_dead_stage_evenly_to_its_peers():
    lay = layout(3, 2, 2, 4)
    cluster = state(lay).with_lost(lay.group(0, 1).ranks[0])
    rerouted = recycle_layout(cluster, lay)
    assert not isinstance(rerouted, str)
    targets = [m.replica for m in rerouted.migrations]
    assert sorted(targets) == [1, 1, 2, 2]  # replica 0's four stage-1 runs, round-robin
    assert {m.stage for m in rerouted.migrations} == {1}
    out = ReCycle(lay).react(cluster)
    assert out.survived and out.moved_bytes == 0  # peers already hold the stage


def test_recycle_stops_when_every_replica_lost_a_stage():
    lay = layout(2, 2, 2, 4)
    cluster = state(lay).with_lost(lay.group(0, 1).ranks[0], lay.group(1, 1).ranks[1])
    out = ReCycle(lay).react(cluster)
    assert not out.survived and "stage-1" in out.reason


def test_oobleck_templates_balance_stages_and_fit_memory():
    lay = layout(2, 2, 2, 4)
    cluster = state(lay)
    split = template_split(cluster, 2, 2)
    assert split is not None and sum(split) == 8
    tiny = state(lay, memory=1.5 * GiB)
    assert template_split(tiny, 2, 1) is None  # 8 layers on one TP-2 unit do not fit


def test_oobleck_reforms_shorter_pipelines_and_stops_without_a_copy():
    lay = layout(2, 2, 4, 4)
    cluster = state(lay)
    oob = Oobleck(lay, cluster)
    out = oob.react(cluster.with_lost(0))
    assert out.survived
    assert sorted(x.pp for x in out.layouts) == [1, 2]  # the survivor unit runs alone
    assert sum(x.microbatches[0] for x in out.layouts) == 8
    # both copies of stage 0's layers gone: no state to rebuild from
    out = Oobleck(lay, cluster).react(cluster.with_lost(0, 4))
    assert not out.survived and "layer 0" in out.reason


def test_ours_survives_where_recycle_and_oobleck_stop():
    lay = layout(2, 2, 4, 4)
    cluster = state(lay).with_lost(0, 4)  # one device of each replica's stage-0 group
    assert not ReCycle(lay).react(cluster).survived
    assert not Oobleck(lay, state(lay)).react(cluster).survived
    ours = ResiHP(lay).react(cluster)
    assert ours.survived and math.isfinite(ours.time_s)


def test_adaptra_deepens_the_warm_up_before_a_slow_link():
    lay = layout(2, 2, 4, 8)
    slow = state(lay).with_slow(lay.group(0, 0).ranks[0], link_speed=0.003)
    out = Adaptra(lay).react(slow)
    (new,) = out.layouts
    assert new.inflight[0][0] > lay.inflight[0][0]
    assert out.time_s < NoMitigation(lay).react(slow).time_s
