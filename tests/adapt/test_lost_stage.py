"""A pipeline job (one replica at TP 1) that loses a device for good continues on the devices
left: the coordinator gives them a smaller even pipeline (`shrink_pipeline`), the generation
spec carries it, the survivors' state managers take the new geometry, and the newest checkpoint
is loaded under the new plan (`unbroken.engine.ckpt_layout`). At TP 1 the plan's depth does not
change the bits, so the run is bit-exact against the fault-free run on the original plan, whose
state hash is taken per parameter, whichever rank holds it (`PlanExecutor.job_hash`)."""

from __future__ import annotations

import dataclasses

import pytest

from unbroken.api import run_job
from unbroken.config import ParallelConfig
from unbroken.metrics.log import read_jsonl
from unbroken.metrics.summary import format_table

from .conftest import adapt_job, events_of, run_bit_exact


def pipeline_job(*, pp: int, inject, iterations: int = 8, interval: int = 2, mode="inplace"):
    cfg = adapt_job(world_size=pp, iterations=iterations, inject=inject)
    return dataclasses.replace(
        cfg,
        parallel=ParallelConfig(world_size=pp, pp=pp),
        checkpoint=dataclasses.replace(cfg.checkpoint, interval=interval),
        recovery=dataclasses.replace(cfg.recovery, mode=mode),
    )


# Slow tier for CI time (~11 s): the TP x PP case below runs the same shrink from a checkpoint.
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_lost_stage_continues_on_a_shorter_pipeline_from_a_checkpoint_bit_exact(tmp_path):
    cfg = pipeline_job(pp=2, inject=["lose:rank=1,iter=5,phase=backward"])
    s = run_job(cfg, tmp_path, reference=True, quiet=True)
    assert s["state"] == "done", s["reason"]
    assert (s["failures_detected"], s["failures_recovered"]) == (1, 1)
    assert s["bit_exact"] is True and s["per_iteration_mismatches"] == []
    events = [e for e in read_jsonl(tmp_path / "events.jsonl") if e["run"] == "faulty"]
    (replan,) = events_of(events, "replan")
    assert replan["trigger"]["kind"] == "device_lost" and replan["trigger"]["devices"] == [1]
    assert (replan["devices_before"], replan["devices_after"]) == ([0, 1], [0])
    assert [st["layers"] for st in replan["before"]] == [[0, 1], [1, 2]]  # the tiny model
    assert [st["layers"] for st in replan["after"]] == [[0, 2]]
    (loaded,) = events_of(events, "checkpoint_loaded")
    assert loaded["resharded"] is True and 0 < loaded["iter"] <= 5
    (applied,) = events_of(events, "plan_applied")
    assert applied["iter"] == loaded["iter"] and applied["devices"] == [0]
    done = events_of(events, "trainer_done")[-1]
    assert done["devices"] == [0] and len(done["rank_hashes"]) == 1


@pytest.mark.timeout(900)
def test_a_tp_pipeline_that_loses_a_stage_continues_at_its_tp_degree_from_a_checkpoint(tmp_path):
    """TP 2 x PP 2, one replica: device 2 (stage 1's first TP rank) is lost for good, so no
    replica is whole. The survivors run the job as TP 2 x PP 1 on devices 0 and 1 (device 3
    stands by) from the newest checkpoint resharded to it; the same TP degree keeps every
    layer's bits, so the run is bit-exact against the fault-free run on the launch plan."""
    cfg = pipeline_job(pp=2, inject=["lose:rank=2,iter=5,phase=backward"])
    cfg = dataclasses.replace(cfg, parallel=ParallelConfig(world_size=4, tp=2, pp=2))
    s = run_job(cfg, tmp_path, reference=True, quiet=True)
    assert s["state"] == "done", s["reason"]
    assert s["bit_exact"] is True and s["per_iteration_mismatches"] == []
    events = [e for e in read_jsonl(tmp_path / "events.jsonl") if e["run"] == "faulty"]
    (replan,) = events_of(events, "replan")
    assert replan["trigger"]["devices"] == [2] and replan["restore"] == "checkpoint"
    assert (replan["devices_before"], replan["devices_after"]) == ([0, 1, 2, 3], [0, 1])
    assert [(st["layers"], st["tp"]) for st in replan["after"]] == [([0, 2], 2)]
    (loaded,) = events_of(events, "checkpoint_loaded")
    assert loaded["resharded"] is True and 0 < loaded["iter"] <= 5
    done = events_of(events, "trainer_done")[-1]
    assert done["devices"] == [0, 1] and len(done["rank_hashes"]) == 2


@pytest.mark.timeout(900)
def test_a_tp_2_job_down_to_one_device_continues_at_tp_1_computing_as_tp_2(tmp_path):
    """TP 2 on 2 devices (one replica): device 1 is lost for good inside its update. No TP
    group of 2 can be formed; device 0 runs the job at TP 1, computing as the TP-2 group did
    (`unbroken.engine.emulate`), from the newest checkpoint resharded to the whole tensors —
    bit-exact against the fault-free TP-2 run."""
    cfg = pipeline_job(pp=1, inject=["lose:rank=1,iter=5,phase=update"])
    cfg = dataclasses.replace(cfg, parallel=ParallelConfig(world_size=2, tp=2))
    _, events = run_bit_exact(cfg, tmp_path)
    (replan,) = events_of(events, "replan")
    assert replan["trigger"]["devices"] == [1] and replan["restore"] == "checkpoint"
    assert (replan["devices_before"], replan["devices_after"]) == ([0, 1], [0])
    assert [(st["layers"], st["tp"]) for st in replan["after"]] == [([0, 2], 1)]
    assert "computing as TP 2" in replan["explain"]
    (loaded,) = events_of(events, "checkpoint_loaded")
    assert loaded["resharded"] is True
    assert not events_of(events, "replay_point")  # the launch bits: nothing to replay


@pytest.mark.timeout(900)
def test_a_tp_4_job_below_its_degree_continues_at_tp_2_audited_against_a_replaying_reference(
    tmp_path,
):
    """TP 4 on 4 devices (one replica): device 1 is lost for good. Three survivors hold no TP
    group of 4; two of them run the job at TP 2 from the newest checkpoint, the third stands
    by. A TP-2 group sums in another order than a TP-4 one, so the bits change: the run keeps
    that checkpoint, the fault-free reference runs again from it under the TP-2 plan, and the
    run must match the launch-plan reference before the change and that replay after it
    ([Note: replayed plan change] in `unbroken.launch.coordinator.adapt_plan`)."""
    cfg = pipeline_job(pp=1, inject=["lose:rank=1,iter=5,phase=backward"])
    cfg = dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, n_kv_heads=4),
        parallel=ParallelConfig(world_size=4, tp=4),
    )
    s, events = run_bit_exact(cfg, tmp_path)
    (replan,) = events_of(events, "replan")
    assert replan["restore"] == "checkpoint" and replan["replayed"] is True
    assert (replan["devices_before"], replan["devices_after"]) == ([0, 1, 2, 3], [0, 2])
    assert [(st["layers"], st["tp"]) for st in replan["after"]] == [([0, 2], 2)]
    (loaded,) = events_of(events, "checkpoint_loaded")
    (point,) = events_of(events, "replay_point")
    assert point["iteration"] == loaded["iter"] and 0 < loaded["iter"] <= 5
    assert point["world"] == 2
    (replay,) = s["replays"]
    assert (replay["iteration"], replay["tp"], replay["from_checkpoint"]) == (
        loaded["iter"],
        [2],
        True,
    )
    # The change did change the bits: against the launch-plan reference alone the run's
    # final state differs; the replay is what it matches.
    assert s["launch_reference_state_hash"] != s["final_state_hash"]
    assert s["reference_state_hash"] == replay["final_state_hash"] == s["final_state_hash"]
    assert "changed the bits" in format_table(s.to_dict())
    replayed = [e for e in read_jsonl(tmp_path / "events.jsonl") if e["run"] == "replay1"]
    assert not events_of(replayed, "failure_detected")
    assert events_of(replayed, "checkpoint_loaded")[0]["iter"] == loaded["iter"]
