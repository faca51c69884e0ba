"""Discrete-event mode: agreement with the closed form, traces, overlaps, lost work."""

from __future__ import annotations

import pytest

from unbroken.errors import UserError
from unbroken.sim.des import Failure, IterFailure, replay_iterations, simulate, simulate_once
from unbroken.sim.ettr import closed_form
from unbroken.sim.policy import FailureMix, KindCost, PolicyTerms, StepCosts, policy_terms
from unbroken.sim.scenario import load_scenario

STEPS = StepCosts(t_iter_s=10.0, t_ckpt_s=2.0, load_remote_s=3.0, load_local_s=0.5, rmu_s=0.05)


def _terms(rollback_init: float = 20.0, hof_init: float = 5.0) -> PolicyTerms:
    return PolicyTerms(
        policy="hand",
        applicable=True,
        reason="",
        t_iter_s=10.0,
        omega=0.0,
        t_ckpt_s=1.0,
        interval=5,
        usable_lag=1,
        costs={
            "fatal": KindCost(detect_s=0.0, init_s=rollback_init, lost_iters=3.5, rollback=True),
            "hof": KindCost(detect_s=0.0, init_s=hof_init, lost_iters=0.5, rollback=False),
            "fail-slow": KindCost(
                detect_s=0.0, init_s=rollback_init, lost_iters=3.5, rollback=True
            ),
        },
    )


def test_trace_replay_by_hand_rollback():
    # Iteration k ends at 10k + floor((k-1)/5) (1 s save after every 5th). A fatal failure at
    # t=73 (iteration 8 in flight, 7 done) restores checkpoint 5 (checkpoint 5 is usable once
    # iteration 6 completed); training resumes at 93. By t=200, 15 iterations are done.
    run = simulate_once(_terms(), trace=[Failure(73.0, "fatal")], horizon_s=200.0)
    assert run.iterations == 15
    assert run.ettr == pytest.approx(15 * 10 / 200)


def test_trace_replay_by_hand_in_place():
    # Same failure as a HOF: progress 7 is kept, resume at 78; by t=200, 19 iterations.
    run = simulate_once(_terms(), trace=[Failure(73.0, "hof")], horizon_s=200.0)
    assert run.iterations == 19
    assert run.ettr == pytest.approx(0.95)


def test_checkpoint_not_yet_usable_forces_a_longer_rollback():
    # At t=55 iteration 6 is in flight: checkpoint 5 is saved but not yet usable (lag 1),
    # so the rollback goes to iteration 0.
    run = simulate_once(_terms(), trace=[Failure(55.0, "fatal")], horizon_s=100.0)
    assert run.lost_iters == pytest.approx(5 + (55 - 51) / 10)


def test_failure_during_recovery_counts_as_overlap_and_restarts_recovery():
    trace = [Failure(73.0, "fatal"), Failure(80.0, "fatal")]
    run = simulate_once(_terms(), trace=trace, horizon_s=300.0)
    assert run.overlapping == 1
    # Second recovery ends at 100 (80 + 20) instead of 93.
    alone = simulate_once(_terms(), trace=trace[:1], horizon_s=300.0)
    assert alone.iterations - run.iterations == 1  # 7 s later: one iteration fewer by t=300


def test_iteration_keyed_replay_fires_each_failure_once():
    # Failure in iteration 8 at 50 %: starts at 71, fails at 76, restores 5, resumes at 96.
    # Iterations 6..10 then end at 106, 116, 126, 136, 146 (no save after 5 again).
    run = replay_iterations(_terms(), [IterFailure(8, 0.5, "fatal")], target_iters=10)
    assert run.wall_s == pytest.approx(146.0)
    assert run.ettr == pytest.approx(100 / 146)


def test_rejects_ambiguous_inputs():
    with pytest.raises(UserError):
        simulate_once(_terms(), horizon_s=10.0)
    with pytest.raises(UserError):
        Failure(1.0, "meteor")


@pytest.mark.parametrize("policy", ["inplace", "gemini+", "gemini"])
@pytest.mark.parametrize("h", [0.0, 0.5, 1.0])
def test_des_agrees_with_closed_form_where_assumptions_hold(policy, h):
    mix = FailureMix(mttf_s=6 * 3600.0, hof_ratio=h)
    terms = policy_terms(policy, STEPS, mix)
    cf = closed_form(terms, mix)
    assert cf.warnings == []
    res = simulate(terms, mix, horizon_s=400 * mix.mttf_s, replications=4, seed=7)
    assert abs(res.ettr - cf.ettr) < 0.01
    assert res.ci95 is not None and res.ci95[0] < res.ettr < res.ci95[1]


def test_observed_lost_work_matches_i_over_2_plus_1():
    mix = FailureMix(mttf_s=48 * 3600.0, hof_ratio=0.0)
    terms = policy_terms("gemini+", STEPS, mix)
    res = simulate(terms, mix, horizon_s=300 * mix.mttf_s, replications=3, seed=3)
    expected = terms.costs["fatal"].lost_iters
    assert res.mean_lost_iters == pytest.approx(expected, rel=0.1)


@pytest.mark.slow
@pytest.mark.parametrize("mttf", [1800.0, 3600.0])
def test_long_runs_of_the_fig14_workloads_agree_within_one_point(mttf):
    scenario = load_scenario(preset="leto-fig14")
    for wl in scenario.workloads:
        for h in (0.0, 0.5, 1.0):
            mix = FailureMix(mttf_s=mttf, hof_ratio=h)
            for policy in ("inplace", "gemini+"):
                terms = policy_terms(policy, wl.steps, mix, scenario.recovery)
                cf = closed_form(terms, mix)
                res = simulate(terms, mix, horizon_s=5000 * mttf, replications=8, seed=11)
                assert abs(res.ettr - cf.ettr) < 0.01, (wl.label, h, policy, res.ettr, cf.ettr)


def test_overlap_is_reported_where_the_closed_form_breaks():
    # Fig. 14's 10-minute MTTF: Gemini recovers for ~2 minutes, so failures overlap; the DES
    # sees them and the closed form warns.
    scenario = load_scenario(preset="leto-fig14")
    wl = scenario.workloads[1]
    mix = FailureMix(mttf_s=600.0, hof_ratio=0.0)
    terms = policy_terms("gemini", wl.steps, mix, scenario.recovery)
    cf = closed_form(terms, mix)
    res = simulate(terms, mix, horizon_s=500 * 600.0, replications=2, seed=1)
    assert res.overlapping > 0
    assert any("assumption 2" in w for w in cf.warnings)


def test_fail_slow_costs_the_degraded_window_then_a_fatal_recovery():
    # Fail-slow at t=73: 60 s at half speed, evicted at 133 like a fatal failure. Its progress
    # at 133 is what a healthy run has at 103; compared with a fatal failure at 103 the run
    # is 30 s (three iterations) behind.
    slow = simulate_once(_terms(), trace=[Failure(73.0, "fail-slow")], horizon_s=1000.0,
                         slow=(60.0, 2.0))  # fmt: skip
    assert slow.failures == {"hof": 0, "fatal": 0, "fail-slow": 1}
    fatal = simulate_once(_terms(), trace=[Failure(133.0 - 30.0, "fatal")], horizon_s=1000.0)
    assert fatal.iterations - slow.iterations == 3
    mix = FailureMix(mttf_s=6 * 3600.0, hof_ratio=0.3, fail_slow_ratio=0.3)
    terms = policy_terms("inplace", STEPS, mix)
    res = simulate(terms, mix, horizon_s=400 * mix.mttf_s, replications=4, seed=5)
    assert abs(res.ettr - closed_form(terms, mix).ettr) < 0.01


def test_in_place_recovery_after_the_gradients_keeps_the_iteration():
    # Iteration 8 runs 71..81; a HOF at 50 % (t=76) in the update phase: RMU finishes the
    # update after the 5 s recovery, so iteration 8 ends at 76 + 5 + 5 = 86, not 81 + 10.
    kept = replay_iterations(_terms(), [IterFailure(8, 0.5, "hof", keeps_in_flight=True)], 8)
    redo = replay_iterations(_terms(), [IterFailure(8, 0.5, "hof")], 8)
    assert kept.wall_s == pytest.approx(86.0)
    assert redo.wall_s == pytest.approx(91.0)
    assert kept.lost_each == [0.0] and redo.lost_each == [0.5]
