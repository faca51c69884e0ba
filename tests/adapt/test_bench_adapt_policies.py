"""`unbroken bench adapt`'s policies, without running jobs: each bench policy is the job's
`adapt.policy` (or no re-planning), every run checkpoints at the same interval, and a
`--policies` subset always runs ours first."""

from __future__ import annotations

import argparse

import pytest

from unbroken.bench import adapt as bench
from unbroken.errors import UserError


def _args(**kw) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    return p.parse_args([f"--{k.replace('_', '-')}={v}" for k, v in kw.items()])


def test_each_policy_is_the_jobs_adapt_policy_and_every_run_checkpoints_alike():
    args = _args(ckpt_interval=3)
    jobs = {p: bench._job(args, [], p) for p in bench.POLICIES}
    assert {p: (j.adapt.enabled, j.adapt.policy) for p, j in jobs.items()} == {
        "ours": (True, "resihp"),
        "none": (False, "resihp"),
        "evict": (True, "evict"),
        "greyhound": (True, "greyhound"),
    }
    assert {j.checkpoint.interval for j in jobs.values()} == {3}
    assert {j.parallel.reduce for j in jobs.values()} == {"ordered"}


def test_a_policy_subset_runs_ours_first_and_an_unknown_name_is_one_line():
    assert bench._policies("greyhound,none") == ["ours", "none", "greyhound"]
    assert bench._policies(_args().policies) == list(bench.POLICIES)
    with pytest.raises(UserError, match="unknown oobleck"):
        bench._policies("ours,oobleck")


def test_the_load_scenario_is_fault_free_and_its_line_compares_ours_with_none():
    assert bench._scenarios(_args(), {"medium": 7.0, "severe": 12.0})["load"] == []
    rows = [
        {"plan": "dp4", "scenario": "load", "policy": "ours", "tokens_per_s": 980.0, "replans": 1},
        {"plan": "dp4", "scenario": "load", "policy": "none", "tokens_per_s": 1000.0, "replans": 0},
    ]
    line = bench._load_line(rows)
    assert line is not None and "re-planned 1 time(s)" in line and "+2.0% lower" in line
    assert bench._load_line(rows[:1]) is None  # no mitigation not run: nothing to compare
    rows[0]["replans"] = 0  # the same job twice: a difference is the load's noise, not a cost
    line = bench._load_line(rows)
    assert line is not None and "cost nothing" in line and "-2.0%" in line
    # Both plans: a clause each, the data-parallel one first.
    rows += [{**r, "plan": "pp2xdp2", "tokens_per_s": 500.0} for r in rows]
    line = bench._load_line(rows)
    assert line is not None and line.index("dp4:") < line.index("pp2xdp2:")
    assert line.count("cost nothing") == 2


def test_both_launch_plans_run_by_default_and_the_pipeline_one_is_pp2_x_dp2():
    args = _args()
    assert bench._plans(args.plans) == ["dp", "pp2"]
    job = bench._job(args, [], "ours", "pp2")
    assert (job.parallel.pp, job.parallel.dp, job.parallel.reduce) == (2, 2, "ordered")
    assert job.adapt.enabled and bench._plan_name(args, "pp2") == "pp2xdp2"
    assert job.model.n_layers is None  # the tiny preset's two layers
    # --layers 4: layers can move between a pipeline's stages; the plan's name says so.
    four = _args(layers=4)
    assert bench._job(four, [], "ours", "pp2").model.n_layers == 4
    assert bench._plan_name(four, "pp2") == "pp2xdp2-l4"
    # tp2: TP = 2 x DP = W/2, asked for by name.
    assert bench._plans("dp,tp2") == ["dp", "tp2"]
    tp = bench._job(args, [], "ours", "tp2").parallel
    assert (tp.tp, tp.dp, tp.pp) == (2, 2, 1) and bench._plan_name(args, "tp2") == "tp2xdp2"
    with pytest.raises(UserError, match="unknown tp4"):
        bench._plans("dp,tp4")


def test_a_row_says_how_each_replan_ran():
    shrink = {"restore": "reshard", "counts_after": [2, 6], "tp_after": [1, 2]}
    assert bench._what(shrink) == "reshard [2, 6] tp [1, 2]"
    assert bench._what({"restore": None, "counts_after": [5, 5, 5, 1]}) == "live [5, 5, 5, 1]"


def test_severity_levels_are_calibrated_to_the_loss_they_cost_on_this_machine():
    from unbroken.detect.levels import throughput_loss

    # Factor 4 cost 39 % on the 2-core VM: a share of ~0.21 of the rank's iteration stretched.
    share = bench.effective_share(0.39, 4.0)
    assert share == pytest.approx((1 / 0.61 - 1) / 3)
    factors = bench.level_factors(_args(), share)
    assert throughput_loss(factors["medium"], share) == pytest.approx(0.55)
    assert throughput_loss(factors["severe"], share) == pytest.approx(0.70)
    assert factors["medium"] < factors["severe"]
    # On dedicated devices (share 1) the levels are detect.levels' own factors.
    assert bench.level_factors(_args(), 1.0)["severe"] == pytest.approx(1 + (1 / 0.3 - 1))
    given = bench.level_factors(_args(severe_factor=9), share)
    assert given["severe"] == 9.0 and given["medium"] == factors["medium"]
    assert bench.effective_share(0.0, 4.0) == 1.0  # a probe that cost nothing: no calibration


def test_the_scenarios_slow_a_rank_lose_a_device_slow_a_link_and_mix_them():
    args = _args(at=14, iterations=40)
    sc = bench._scenarios(args, {"medium": 6.74, "severe": 11.95})
    # The device's slow-downs, to the end of the run: they outlast the trainers a re-plan's
    # restart replaces (a slow device taken out and re-admitted on trial is still slow).
    assert sc["medium"] == ["slow:rank=3,iter=14,factor=6.74,until=41"]
    assert sc["severe"] == ["slow:rank=3,iter=14,factor=11.9,until=41"]
    assert sc["slowlink"] == ["slow:rank=3,iter=14,what=comm,level=medium"]
    assert sc["mixed"] == [
        "lose:rank=1,iter=14,phase=update",
        "slow:rank=3,iter=17,factor=11.9,until=41",
    ]
    assert tuple(sc) == bench.SCENARIOS
    with pytest.raises(UserError, match="--scenarios: unknown slow"):
        bench._names("slow,lost", bench.SCENARIOS, "--scenarios")
    from unbroken.inject import parse_fault

    for faults in sc.values():
        for f in faults:
            parse_fault(f)  # every spec is one the injector takes
