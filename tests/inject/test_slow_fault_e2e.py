"""Real multi-process runs (gloo): compute and comm slow faults stall for real and leave the
training result bit-identical to the fault-free reference."""

from __future__ import annotations

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
