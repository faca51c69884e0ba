"""Steps 2 and 3: repartition, reordering and migration are chosen by the simulator and never
make a layout slower."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.plan.helpers import GiB, layout, state
from unbroken.parallel import make_plan
from unbroken.parallel.simulate import simulate
from unbroken.plan import PlannerConfig, Scorer, plan_for_state
from unbroken.plan.balance import balance_counts, balance_simulated
from unbroken.plan.layout import Layout
from unbroken.plan.migration import auto_delta, migrate, progress_pass
from unbroken.plan.repartition import deepen_inflight, repartition, repartition_each


def test_a_slow_stage_gives_layers_away():
    lay = layout(1, 3, 1, 6, layers=12)
    cluster = state(lay).with_slow(lay.group(0, 1).ranks[0], speed=0.4)
    scorer = Scorer(cluster)
    before = scorer.time(lay)
    imp = repartition(scorer, lay, before)
    assert imp.time < before
    split = imp.layout.split(0)
    assert split[1] < 4 and split[0] + split[2] > 8  # Figure 5: (4, 4, 4) -> fewer in the middle
    assert imp.notes and "layers per stage" in imp.notes[0]


def test_repartition_respects_memory():
    lay = layout(1, 2, 1, 4)
    need = max(
        state(lay).workload.device_bytes(g.layers, 1, lay.inflight[0][s])
        for s, g in enumerate(lay.replicas[0].stages)
    )
    cluster = state(lay, memory=need * 1.01).with_slow(lay.group(0, 1).ranks[0], speed=0.3)
    scorer = Scorer(cluster)
    imp = repartition(scorer, lay, scorer.time(lay))
    assert imp.layout.split(0) == lay.split(0)  # one more layer on stage 0 would not fit


def test_reordering_hides_a_slow_link_and_migration_balances_replicas():
    lay = layout(2, 2, 4, 8)  # one node per stage: the boundary is on the network
    cluster = state(lay).with_slow(lay.group(0, 0).ranks[0], link_speed=0.003)
    scorer = Scorer(cluster)
    base = scorer.time(lay)
    deeper = deepen_inflight(scorer, lay, base)
    assert deeper.time < base
    assert deeper.layout.inflight[0][0] > lay.inflight[0][0]
    moved = migrate(scorer, deeper.layout, deeper.time, ownership=False)
    assert moved.time <= deeper.time


def test_algorithm1_moves_stages_of_the_lagging_replica_to_the_leading_one():
    lay = layout(2, 2, 1, 8)
    cluster = state(lay).with_slow(lay.group(0, 0).ranks[0], speed=0.5)
    scorer = Scorer(cluster)
    new = progress_pass(scorer, lay, delta=1)
    assert new and all(m.replica == 1 for m in new)
    assert all(lay.skeleton.owner(m.microbatch) == 0 for m in new)
    assert auto_delta(lay) == 1
    imp = migrate(scorer, lay, scorer.time(lay), ownership=False)
    assert imp.time < scorer.time(lay)
    assert imp.layout.microbatches == lay.microbatches  # ownership kept: work moved by migration


def test_balance_counts_minimizes_the_variance_of_load():
    assert balance_counts([1.0, 1.0], 8) == [4, 4]
    assert balance_counts([1.0, 3.0], 8) == [6, 2]
    assert sum(balance_counts([1.0, 2.0, 5.0], 17)) == 17
    assert balance_counts([1.0, 1.0], 6, weights=[2, 1]) == [2, 2]


def test_simulated_balance_never_leaves_the_slowest_replica_slower():
    lay = layout(2, 2, 2, 8)
    cluster = state(lay).with_lost(lay.group(0, 0).ranks[0])
    scorer = Scorer(cluster)
    from unbroken.plan.exclusion import exclude

    shrunk = exclude(cluster, lay).layout
    counts = balance_simulated(scorer, shrunk)
    assert sum(counts) == 16 and counts[0] < counts[1]


def test_per_replica_repartition_reowns_micro_batches():
    lay = layout(2, 2, 1, 8)
    cluster = state(lay).with_slow(lay.group(0, 0).ranks[0], speed=0.5)
    scorer = Scorer(cluster)
    imp = repartition_each(scorer, lay, scorer.time(lay))
    assert imp.time < scorer.time(lay)
    assert imp.layout.split(0) != imp.layout.split(1)
    assert sum(imp.layout.microbatches) == 16


def test_the_ablation_switches_steps_off():
    lay = layout(2, 2, 4, 8)
    cluster = state(lay, memory=40 * GiB).with_slow(1, speed=0.3)
    only = plan_for_state(
        cluster, PlannerConfig(repartition=False, reorder=False, migration=False), current=lay
    )
    assert [s.step for s in only.steps] == ["exclusion"]
    full = plan_for_state(cluster, current=lay)
    assert full.predicted_s <= only.predicted_s
    assert "exclusion" in full.explain()


def test_a_healthy_cluster_keeps_its_plan():
    lay = layout(2, 2, 2, 4)
    result = plan_for_state(state(lay).with_plan(lay.skeleton))
    assert result.predicted_s <= result.current_s
    assert result.standbys == ()


def test_a_replica_left_one_microbatch_gets_its_share_back_when_every_device_is_healthy():
    # The live re-plan around a slow device left replica 0 one micro-batch; its 1F1B list
    # then has one forward in flight: its count, not the schedule's bound. Read as the bound,
    # the re-balance timed replica 0 without pipelining and stopped at [3, 5].
    skewed = make_plan(2, 2, 1, 8, [1, 7])
    assert Layout.from_plan(skewed).inflight == ((2, 1), (2, 1))
    healthy = state(Layout.from_plan(make_plan(2, 2, 1, 8, 4))).with_plan(skewed)
    assert plan_for_state(
        healthy, PlannerConfig(exclusion=False, repartition=False)
    ).plan().microbatches == (4, 4)


def _counts_with_slow_rank(speed: float) -> tuple[Scorer, Layout, tuple[int, ...]]:
    lay = layout(2, 2, 1, 4)
    cluster = state(lay).with_slow(lay.group(1, 1).ranks[0], speed=speed)
    live = PlannerConfig(exclusion=False, repartition=False)
    return Scorer(cluster), lay, plan_for_state(cluster, live).plan().microbatches


def _with_counts(lay: Layout, counts: tuple[int, ...]) -> Layout:
    return Layout(replicas=lay.replicas, microbatches=counts, inflight=lay.inflight)


def test_a_replica_too_slow_for_one_microbatch_gets_none():
    # [Note: empty replica]: at 1/20 speed one micro-batch on replica 1 takes longer than all
    # eight on replica 0, so the planner empties it, and the simulator agrees it is faster.
    scorer, lay, counts = _counts_with_slow_rank(0.05)
    assert counts == (8, 0)
    assert scorer.time(_with_counts(lay, (8, 0))) < scorer.time(_with_counts(lay, (7, 1)))
    assert balance_simulated(scorer, lay) == [8, 0]
    # An executor that keeps every replica computing (the data-parallel trainer) is not
    # offered it: the counts the planner gave before empty replicas existed.
    assert balance_simulated(scorer, lay, floor=1) == [7, 1]
    keep = PlannerConfig(exclusion=False, repartition=False, empty_replicas=False)
    assert plan_for_state(scorer.state, keep).plan().microbatches == (7, 1)


def test_a_slow_replica_keeps_work_while_one_microbatch_there_is_faster():
    scorer, lay, counts = _counts_with_slow_rank(0.25)
    assert min(counts) >= 1 and sum(counts) == 8
    assert scorer.time(_with_counts(lay, counts)) < scorer.time(_with_counts(lay, (8, 0)))


def test_a_slow_devices_own_step_counts_against_keeping_one_microbatch_there():
    # The planner times one steady-state iteration (`unbroken.parallel.simulate`): a slow
    # device steps its optimizer slowly too, and that step runs before its next compute. With a
    # step of ~3 micro-batches' compute (the tiny CPU model's shape, bench/results/adapt-cpu.md
    # stop 42) one micro-batch left on a 4x slow replica waits for that 4x step, while the
    # other replica's eight overlap it — the planner empties the replica at 4x, where a model
    # without the step kept [7, 1] up to ~8x (stop 43).
    lay = layout(2, 2, 1, 4)
    slow = lay.group(1, 1).ranks[0]
    heavy = state(lay)
    heavy = heavy.with_workload(replace(heavy.workload, step_s_per_param=2e-10))
    live = PlannerConfig(exclusion=False, repartition=False)
    scorer = Scorer(heavy.with_slow(slow, speed=0.25))
    result = plan_for_state(scorer.state, live)
    assert result.plan().microbatches == (8, 0)
    assert scorer.time(result.layout) < scorer.time(_with_counts(result.layout, (7, 1)))
    # Without the step's weight (the toy workload's ~2 ms step) one micro-batch stays there.
    light = state(lay).with_slow(slow, speed=0.25)
    assert plan_for_state(light, live).plan().microbatches != (8, 0)
    # In the replay the slow rank starts 3 healthy steps late (the rest of its 4x step).
    kept = _with_counts(result.layout, (7, 1))
    timeline = simulate(scorer.plan(kept), scorer.costs(kept))
    first = min(t.start for t in timeline.actions if t.rank == slow)
    assert first == pytest.approx(3 * scorer.opt_s(kept))


def test_with_every_rank_meeting_at_the_boundary_a_slow_step_ends_the_iteration():
    """`Workload.boundary_sync` (a live job: every rank meets at every boundary): no group
    leads; the layout's time is its compute and reduction plus the slowest device's own step
    — the healthy closing step and the rest of the slow one, added, not overlapped. Emptying
    the slow replica no longer hides its step, so the counts only even out the compute, and
    a plan without the device (here: the slow stage priced at full speed) gains the whole
    slow step."""
    lay = layout(2, 2, 1, 4)
    slow = lay.group(1, 1).ranks[0]
    base = state(lay)
    heavy = replace(base.workload, step_s_per_param=2e-10)
    overlap = Scorer(base.with_workload(heavy).with_slow(slow, speed=0.25))
    synced = Scorer(
        base.with_workload(replace(heavy, boundary_sync=True)).with_slow(slow, speed=0.25)
    )
    empty = _with_counts(lay, (8, 0))
    opt = synced.opt_s(empty)
    # The slow stage holds the layout's largest step: its 4x step is 3 healthy ones more.
    assert synced.boundary_s(empty) == pytest.approx(3 * opt)
    assert overlap.boundary_s(empty) == 0.0
    without_wait = synced.time(empty, boundary=False)
    assert synced.time(empty) == pytest.approx(without_wait + 3 * opt)
    # The overlap model hides most of the slow step behind replica 0's eight micro-batches.
    assert overlap.time(empty) < synced.time(empty)
    # Balancing sees the compute alone: one or more micro-batches go back to the slow replica
    # while its 4x compute ends before replica 0's.
    live = PlannerConfig(exclusion=False, repartition=False)
    counts = plan_for_state(synced.state, live).plan().microbatches
    assert counts[1] >= 1 and sum(counts) == 8
    healthy = Scorer(base.with_workload(replace(heavy, boundary_sync=True)))
    assert synced.time(empty) - healthy.time(_with_counts(lay, (4, 4))) > 3 * opt


def test_an_empty_replica_gets_its_share_back_when_every_device_is_healthy():
    empty = make_plan(2, 2, 1, 8, [8, 0])
    healthy = state(Layout.from_plan(make_plan(2, 2, 1, 8, 4))).with_plan(empty)
    result = plan_for_state(healthy, PlannerConfig(exclusion=False, repartition=False))
    assert result.plan().microbatches == (4, 4)
    assert result.predicted_s < result.current_s
