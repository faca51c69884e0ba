"""The job store does not grow with recoveries (found by `unbroken bench soak`: 5.7 keys per
recovery, every generation's and every shadow set's rendezvous keys left behind).

A job with three in-place recoveries (L3 shadows prepared, promoted, prepared again) ends with
as many keys as the fault-free job plus the faults' own fired-markers (`inject/<fault>`, one per
scheduled fault, by design)."""

from __future__ import annotations

import dataclasses

from unbroken.api import run_job
from unbroken.metrics.log import read_jsonl

from ..foundation.conftest import tiny_job


def _final_keys(out) -> int:
    (stats,) = [
        e
        for e in read_jsonl(out / "events.jsonl")
        if e["kind"] == "coordinator_stats" and e["final"]
    ]
    return stats["store_keys"]


def test_recoveries_leave_no_rendezvous_keys_behind(tmp_path):
    faults = [f"kill:rank={i % 2},iter={3 + 3 * i},phase=backward" for i in range(3)]
    base = tiny_job(iterations=14, interval=1000)
    base = dataclasses.replace(base, recovery=dataclasses.replace(base.recovery, shadow_level=3))
    run_job(base, tmp_path / "clean", quiet=True)
    faulty = run_job(dataclasses.replace(base, inject=faults), tmp_path / "faulty", quiet=True)
    assert faulty.failures_recovered == 3
    assert _final_keys(tmp_path / "faulty") == _final_keys(tmp_path / "clean") + len(faults)
