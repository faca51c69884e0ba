"""A device of a PP x DP job too slow for its own optimizer step leaves the world in place
(issue 18; [Note: slow device excluded] in `unbroken.launch.coordinator.adapt`,
`PipelineAdaptation._exclude`): its replica is dissolved as for a lost device, the other
replica's ranks keep their layers and computes every micro-batch from their retained state (no
checkpoint), and the dissolved replica's devices stand by. `adapt.readmit_after` iterations
later the launch world comes back on trial (both standbys filled from the other replica);
still slow, the device is found through the trial detector's short warm-up — against its
stage's holder in the other replica (`FailSlowDetector._slow_through_warmup`) — and excluded
again with twice the wait. Bit-exact against the fault-free launch plan (the ordered
reduction)."""

from __future__ import annotations

import dataclasses

import pytest

from .conftest import crash_recovered_after_exclusion, events_of, pp2_job, run_bit_exact


def _exclusion(replan: dict, device: int) -> None:
    trigger = replan["trigger"]
    assert (trigger["kind"], trigger["device"], trigger["excluded"]) == ("fail_slow", device, True)
    assert replan["devices_after"] == [0, 1] and replan["counts_after"] == [8]
    assert replan["restore"] == "in_place"
    assert replan["predicted_after"] < replan["predicted_before"]


@pytest.mark.timeout(600)
def test_a_slow_device_of_a_dp_x_pp_job_leaves_comes_back_on_trial_and_leaves_again(tmp_path):
    cfg = pp2_job(iterations=40, inject=["slow:rank=3,iter=14,factor=8,until=41"], readmit_after=8)
    s, events = run_bit_exact(cfg, tmp_path)
    assert not events_of(events, "checkpoint_loaded")  # in place, every time
    first, second = events_of(events, "device_excluded")[:2]
    assert first["device"] == second["device"] == 3
    assert first["readmit_at"] - first["trigger"]["since_iter"] == 8
    assert second["readmit_at"] - second["trigger"]["since_iter"] == 16
    out, back, out_again, *_ = events_of(events, "replan")
    _exclusion(out, 3)
    assert back["trigger"]["kind"] == "devices_returned" and back["devices_after"] == [0, 1, 2, 3]
    assert back["counts_after"] == [4, 4] and back["restore"] == "in_place"
    _exclusion(out_again, 3)
    # The smaller world ran on devices 0 and 1 only; the trial world on all four, the
    # dissolved replica's two ranks filled from replica 0 at the boundary.
    applied = {e["generation"]: e for e in events_of(events, "plan_applied")}
    assert applied[1]["devices"] == [0, 1] and applied[2]["devices"] == [0, 1, 2, 3]
    filled = [e for e in events_of(events, "inplace_repair") if e.get("generation") == 2]
    assert sorted(e["rank"] for e in filled if e["fixup"] == "filled from a replica") == [2, 3]
    # Reported again through the trial detector's warm-up, a few iterations after the trial.
    (readmitted, *_) = events_of(events, "device_readmitted")
    reports = [f for f in s["fail_slow"] if f["rank"] == 3]
    assert len(reports) >= 2 and reports[1]["detected_at"] - readmitted["iteration"] <= 12


@pytest.mark.slow  # ~30 s; CI runs the exclusion, the trial and the second exclusion above
@pytest.mark.timeout(600)
def test_a_crash_right_after_a_pipeline_exclusion_is_recovered_on_the_one_replica(tmp_path):
    """Device 1's trainer (replica 0's last stage) is killed a few iterations after device 3
    left with its replica: the one-replica world recovers in place (its shadow takes over),
    devices 2 and 3 stay out, and the run is still bit-exact with no checkpoint load."""
    faults = ["slow:rank=3,iter=14,factor=8,until=31", "kill:rank=1,iter=21,phase=update"]
    cfg = pp2_job(iterations=28, inject=faults, readmit_after=50)
    out, started = crash_recovered_after_exclusion(cfg, tmp_path)
    _exclusion(out, 3)
    assert started[1]["devices"] == [0, 1] and started[2]["devices"] == [0, 1]


@pytest.mark.timeout(600)
def test_a_slow_stage_left_alone_after_a_loss_is_found_and_replaced_by_a_standby(tmp_path):
    """`bench adapt`'s mixed schedule on PP2 x DP2: device 1 is lost (replica 0 dissolved in
    place, device 0 stands by), then device 3 — now a stage of the one replica left — slows
    down inside the new world's warm-up. It has no peer, so it is held to its own pace per
    layer in the world before (`SlowWatch.reset(moved=...)`, `FailSlowDetector(references=)`)
    and reported at the warm-up's end; the standby takes its stage from the newest checkpoint
    (`PipelineAdaptation._swap`). Bit-exact against the fault-free launch plan."""
    faults = ["lose:rank=1,iter=14,phase=update", "slow:rank=3,iter=17,factor=8,until=41"]
    cfg = pp2_job(iterations=40, inject=faults)
    cfg = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, interval=5))
    s, events = run_bit_exact(cfg, tmp_path)
    lost, swap = events_of(events, "replan")
    assert lost["trigger"]["kind"] == "device_lost" and lost["devices_after"] == [2, 3]
    assert lost["restore"] == "in_place"
    (report,) = [f for f in s["fail_slow"] if f["rank"] == 1]  # device 3 in the new world
    assert report["since_iter"] > 14  # the new world's warm-up: no change point there
    trigger = swap["trigger"]
    assert (trigger["device"], trigger["excluded"]) == (3, True)
    assert swap["devices_after"] == [0, 2] and swap["restore"] == "checkpoint"
    assert len(events_of(events, "checkpoint_loaded")) == 1
