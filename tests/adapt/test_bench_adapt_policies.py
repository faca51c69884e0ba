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
    assert bench._scenarios(_args())["load"] == []
    rows = [
        {"scenario": "load", "policy": "ours", "tokens_per_s": 980.0, "replans": 1},
        {"scenario": "load", "policy": "none", "tokens_per_s": 1000.0, "replans": 0},
    ]
    line = bench._load_line(rows)
    assert line is not None and "re-planned 1 time(s)" in line and "+2.0% lower" in line
    assert bench._load_line(rows[:1]) is None  # no mitigation not run: nothing to compare
    rows[0]["replans"] = 0  # the same job twice: a difference is the load's noise, not a cost
    line = bench._load_line(rows)
    assert line is not None and "cost nothing" in line and "-2.0%" in line


def test_both_launch_plans_run_by_default_and_the_pipeline_one_is_pp2_x_dp2():
    args = _args()
    assert bench._plans(args.plans) == ["dp", "pp2"]
    job = bench._job(args, [], "ours", "pp2")
    assert (job.parallel.pp, job.parallel.dp, job.parallel.reduce) == (2, 2, "ordered")
    assert job.adapt.enabled and bench._plan_name(args, "pp2") == "pp2xdp2"
    with pytest.raises(UserError, match="unknown tp2"):
        bench._plans("dp,tp2")
