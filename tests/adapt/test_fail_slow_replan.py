"""A validated fail-slow report makes the coordinator re-plan: the planner's placement moves
micro-batches off the slow rank, the ranks adopt it at an iteration boundary they agree on,
and the run stays bit-exact against the fault-free run on the original placement."""

from __future__ import annotations

import pytest

from unbroken.api import run_job
from unbroken.metrics.log import read_jsonl

from .conftest import adapt_job, events_of


@pytest.mark.timeout(900)
def test_a_slow_rank_loses_micro_batches_at_a_boundary_and_the_run_stays_bit_exact(tmp_path):
    # Four micro-batches per shard: fine enough to move work off a slow rank. A large factor,
    # so that the detector's measured factor on a loaded 2-core machine still clears min_gain.
    cfg = adapt_job(iterations=30, microbatches=4, inject=["slow:rank=3,iter=15,factor=6"])
    s = run_job(cfg, tmp_path, reference=True, quiet=True)
    assert s["state"] == "done", s["reason"]
    assert s["bit_exact"] is True and s["per_iteration_mismatches"] == []
    events = [e for e in read_jsonl(tmp_path / "events.jsonl") if e["run"] == "faulty"]
    (report,) = [f for f in s["fail_slow"] if f["rank"] == 3]
    (replan,) = events_of(events, "replan")
    trigger = replan["trigger"]
    assert (trigger["kind"], trigger["rank"], trigger["device"]) == ("fail_slow", 3, 3)
    assert trigger["factor"] == pytest.approx(report["factor"])
    counts = replan["counts_after"]
    assert sum(counts) == 16 and counts[3] < 4 and min(counts) >= 1
    assert replan["predicted_after"] < replan["predicted_before"]
    (applied,) = events_of(events, "plan_applied")
    assert applied["epoch"] == 1 and applied["counts"] == counts
    assert report["detected_at"] < applied["iter"] < 30  # at a boundary after the report
    assert not s["recoveries"]  # no restart: the same generation switched
    assert s["replans"][0]["iter"] == applied["iter"]
