"""`unbroken train` with a plan (tp, pp > 1 in config): the trainer runs its rank of the plan
through the engine on the retained buffers, and in-place recovery stays exact — a crash inside
the update and a page loss are recovered through shadows, bit-identical to the fault-free run
of the same plan."""

from __future__ import annotations

import dataclasses

from unbroken.api import run_job
from unbroken.config import ParallelConfig

from ..foundation.conftest import tiny_job


def test_a_pipeline_and_tensor_parallel_plan_recovers_in_place_exactly(tmp_path):
    faults = [
        "kill:rank=1,iter=4,phase=update",
        "pageloss:rank=2,iter=7,phase=writeback,pages=1,parity=1",
    ]
    cfg = tiny_job(world_size=4, iterations=10, inject=faults, interval=0)
    cfg = dataclasses.replace(cfg, parallel=ParallelConfig(world_size=4, tp=2, pp=2))
    s = run_job(cfg, tmp_path, reference=True, quiet=True)
    assert s["state"] == "done"
    assert s["failures_injected"] == s["failures_recovered"] == 2
    assert {r["mode"] for r in s["recoveries"]} == {"inplace"}
    assert s["bit_exact"] is True and s["per_iteration_mismatches"] == []
