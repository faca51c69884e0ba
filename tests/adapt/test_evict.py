"""The evict-and-restart baseline run live (`adapt.policy = "evict"`, what `unbroken bench
adapt` compares the scheduler with): a validated slow rank is evicted, the job restarts from its
newest checkpoint on the other three ranks with the global batch spread evenly, and the result
is still bit-exact against the fault-free run on four."""

from __future__ import annotations

import dataclasses

import pytest

from unbroken.metrics.log import read_jsonl

from .conftest import adapt_job, events_of, run_bit_exact


@pytest.mark.slow  # ~60 s on 2 cores; CI runs the policy's decisions (test_adaptation, test_fsm)
@pytest.mark.timeout(900)
def test_a_slow_rank_is_evicted_and_the_others_restart_from_a_checkpoint_bit_exact(tmp_path):
    cfg = adapt_job(
        iterations=30, microbatches=4, inject=["slow:rank=3,iter=12,factor=6"], policy="evict"
    )
    cfg = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, interval=4))
    _, events = run_bit_exact(cfg, tmp_path)
    (evicted,) = events_of(events, "device_evicted")
    assert evicted["device"] == 3 and evicted["trigger"]["kind"] == "fail_slow"
    (replan,) = events_of(events, "replan")
    assert replan["trigger"]["kind"] == "device_lost" and replan["trigger"]["devices"] == [3]
    assert replan["devices_after"] == [0, 1, 2] and sorted(replan["counts_after"]) == [5, 5, 6]
    assert events_of(events, "checkpoint_loaded"), "evict-and-restart loads a checkpoint"
    ready = {e["recovery"] for e in events_of(events, "trainer_ready") if e["generation"] == 1}
    assert ready == {"ckpt_restart"}, ready
    rows = [m for m in read_jsonl(tmp_path / "metrics.jsonl") if m["run"] == "faulty"]
    last = max(m["generation"] for m in rows)
    assert last == 1 and len([m for m in rows if m["generation"] == 1][-1]["rank_hashes"]) == 3


@pytest.mark.slow  # ~30 s; CI runs the pipeline policy's decisions (test_pipeline_adaptation)
@pytest.mark.timeout(900)
def test_a_pipeline_job_evicts_a_slow_device_and_restarts_one_even_pipeline_bit_exact(tmp_path):
    from unbroken.config import ParallelConfig

    cfg = adapt_job(
        iterations=30, microbatches=4, inject=["slow:rank=3,iter=12,factor=6"], policy="evict"
    )
    cfg = dataclasses.replace(
        cfg,
        parallel=ParallelConfig(world_size=4, pp=2),
        checkpoint=dataclasses.replace(cfg.checkpoint, interval=4),
    )
    _, events = run_bit_exact(cfg, tmp_path)
    (evicted,) = events_of(events, "device_evicted")
    assert evicted["device"] == 3
    (replan,) = events_of(events, "replan")
    assert replan["trigger"]["devices"] == [3] and replan["restore"] == "checkpoint"
    assert 3 not in replan["devices_after"] and len(replan["after"]) == 2  # PP 2, one replica
    assert events_of(events, "checkpoint_loaded"), "evict-and-restart loads a checkpoint"
