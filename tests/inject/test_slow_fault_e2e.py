"""Real multi-process runs (gloo): compute and comm slow faults stall for real and leave the
training result bit-identical to the fault-free reference."""

from __future__ import annotations

import statistics

import pytest

from unbroken.api import run_job
from unbroken.metrics.log import read_jsonl

from ..foundation.conftest import tiny_job


@pytest.mark.slow
def test_slow_compute_and_comm_faults_keep_the_run_bit_exact(tmp_path):
    faults = ["slow:rank=1,iter=2,factor=1.5", "slow:rank=0,iter=4,level=weak,what=comm"]
    s = run_job(tiny_job(iterations=8, inject=faults), tmp_path, reference=True, quiet=True)
    assert s["state"] == "done"
    assert s["bit_exact"] is True and s["per_iteration_mismatches"] == []
    active = {
        e["what"]: e
        for e in read_jsonl(tmp_path / "events.jsonl")
        if e["kind"] == "slow_active" and e["run"] == "faulty"
    }
    assert active["compute"]["factor"] == 1.5 and active["compute"]["rank"] == 1
    comm = active["comm"]
    assert comm["rank"] == 0 and comm["factor"] > 1 and comm["stall_s"] > 0


@pytest.mark.slow
def test_a_comm_slowed_rank_holds_the_stall_in_its_own_all_reduce_interval(tmp_path):
    # What a comm slowdown looks like to the per-rank phase timings (docs/detect.md): the
    # slowed rank's comm_s holds its stall, its peer's comm_s stays short and its micro-batch
    # timings are unaffected.
    cfg = tiny_job(iterations=10, inject=["slow:rank=1,iter=5,factor=1000,what=comm"])
    s = run_job(cfg, tmp_path, quiet=True)
    assert s["state"] == "done"
    (active,) = [e for e in read_jsonl(tmp_path / "events.jsonl") if e["kind"] == "slow_active"]
    stall = active["stall_s"]
    assert stall == pytest.approx(999 * active["comm_s"]) and stall > 0
    timings = [t for t in read_jsonl(tmp_path / "timings.jsonl") if t["iter"] >= 5]
    comm = {r: statistics.median(t["comm_s"] for t in timings if t["rank"] == r) for r in (0, 1)}
    assert comm[1] >= stall  # the stall is inside rank 1's all-reduce interval
    assert comm[0] < 0.5 * stall  # rank 0 left its all-reduce on time
