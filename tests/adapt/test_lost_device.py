"""A data-parallel job that loses a device for good continues on the remaining ranks: each
survivor keeps its retained replica (no checkpoint is loaded), the lost replica's micro-batches
go to the survivors, and the run is bit-exact against the fault-free run on the original four
ranks — the stretch of issue 18 ([Note: ordered reduction])."""

from __future__ import annotations

import pytest

from unbroken.api import run_job
from unbroken.metrics.log import read_jsonl

from .conftest import adapt_job, events_of


@pytest.mark.slow  # 28 s: CI time; CI keeps a lost device of a DP x PP job (test_lost_replica)
# and a data-parallel node lost and planned around (tests/launch/test_multinode.py)
@pytest.mark.timeout(900)
def test_a_lost_device_is_planned_around_in_place_and_stays_bit_exact(tmp_path):
    cfg = adapt_job(inject=["lose:rank=1,iter=3,phase=update"])
    s = run_job(cfg, tmp_path, reference=True, quiet=True)
    assert s["state"] == "done", s["reason"]
    assert (s["failures_detected"], s["failures_recovered"]) == (1, 1)
    assert s["bit_exact"] is True and s["per_iteration_mismatches"] == []
    events = [e for e in read_jsonl(tmp_path / "events.jsonl") if e["run"] == "faulty"]
    (detected,) = events_of(events, "failure_detected")
    assert detected["cause"] == "device_lost" and "device 1 lost" in detected["reason"]
    (replan,) = events_of(events, "replan")
    assert replan["trigger"]["kind"] == "device_lost" and replan["trigger"]["devices"] == [1]
    assert (replan["devices_before"], replan["devices_after"]) == ([0, 1, 2, 3], [0, 2, 3])
    assert sorted(replan["counts_after"]) == [2, 3, 3]  # the global batch: 8 micro-batches
    assert not events_of(events, "checkpoint_loaded")
    assert len(events_of(events, "inplace_repair")) == 3  # the survivors, in place
    (recovery,) = s["recoveries"]
    assert recovery["mode"] == "inplace" and recovery["fault"] == "lose"
    done = events_of(events, "trainer_done")[-1]
    assert done["devices"] == [0, 2, 3] and len(done["rank_hashes"]) == 3
    applied = events_of(events, "plan_applied")
    assert applied[-1]["devices"] == [0, 2, 3] and applied[-1]["epoch"] == 1


@pytest.mark.timeout(900)
def test_a_job_that_does_not_replan_fails_on_a_lost_device_with_the_reason(tmp_path):
    import dataclasses

    cfg = adapt_job(world_size=2, iterations=6, inject=["lose:rank=1,iter=2,phase=forward"])
    cfg = dataclasses.replace(cfg, adapt=dataclasses.replace(cfg.adapt, enabled=False))
    s = run_job(cfg, tmp_path, quiet=True)
    assert s["state"] == "failed"
    assert "device 1 lost" in s["reason"]


# Slow tier since stop 41 (~26 s; CI was at its 20-minute limit): the CI tier still loads a
# checkpoint under the plan left after a lost device — a pipeline shrunk to fewer stages, the
# harder case of a new layout — in tests/adapt/test_lost_stage.py.
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_without_retained_state_the_survivors_restart_from_a_checkpoint_on_fewer_ranks(tmp_path):
    import dataclasses

    cfg = adapt_job(inject=["lose:rank=2,iter=4,phase=forward"])
    cfg = dataclasses.replace(
        cfg,
        recovery=dataclasses.replace(cfg.recovery, mode="ckpt_restart"),
        checkpoint=dataclasses.replace(cfg.checkpoint, interval=2),
    )
    s = run_job(cfg, tmp_path, reference=True, quiet=True)
    assert s["state"] == "done", s["reason"]
    assert s["bit_exact"] is True and s["per_iteration_mismatches"] == []
    events = [e for e in read_jsonl(tmp_path / "events.jsonl") if e["run"] == "faulty"]
    (loaded,) = events_of(events, "checkpoint_loaded")  # rank 0 reports; three ranks load it
    assert 0 < loaded["iter"] <= 4
    assert events_of(events, "trainer_done")[-1]["devices"] == [0, 1, 3]
