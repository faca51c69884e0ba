"""A PP x DP job re-plans live around a slow device (issue 18 items 2 and 4, ResiHP §6.3).

PP = 2 x DP = 2 on 4 local ranks with `adapt.enabled`. Rank 0 (replica 0's first stage) runs
4x slower from iteration 4 on. The fail-slow watch (which simulates the plan) reports it, the
coordinator asks the scheduler for a plan that keeps every rank's layers — micro-batches move
to replica 1 — and publishes it; every rank switches at the same boundary on its own state
(no restart, no checkpoint). The run ends bit for bit where the fault-free run on the launch
plan ends (the ordered reduction), and after the switch replica 0 computes fewer
micro-batches than replica 1."""

from __future__ import annotations

import dataclasses

import pytest

from unbroken.api import run_job
from unbroken.config import ParallelConfig
from unbroken.metrics.log import read_jsonl

from .conftest import adapt_job, events_of


def _pp2_run(tmp_path, iterations: int, inject: list[str]) -> tuple[dict, list[dict]]:
    """PP = 2 x DP = 2 on 4 ranks with `adapt.enabled` and `inject`, beside its fault-free
    reference: the summary (done, bit for bit the reference) and the faulty run's events.
    The slow device stays in the world (`adapt.readmit_after` 0): at 6x ours would take it
    out (tests/adapt/test_pipeline_exclusion.py)."""
    cfg = adapt_job(
        world_size=4, iterations=iterations, microbatches=4, inject=inject, readmit_after=0
    )
    cfg = dataclasses.replace(cfg, parallel=ParallelConfig(world_size=4, pp=2))
    s = run_job(cfg, tmp_path, reference=True, quiet=True)
    assert s["state"] == "done", s["reason"]
    assert s["bit_exact"] is True and s["per_iteration_mismatches"] == []
    return s, [e for e in read_jsonl(tmp_path / "events.jsonl") if e["run"] == "faulty"]


@pytest.mark.slow  # ~40 s; CI reached 19:53 at stop 43. CI keeps its parts: the fail-slow
# loop end to end on a data-parallel job (tests/test_demo.py), a pipeline's live switch on a
# slow device (tests/adapt/test_live_repartition.py), live switches of a DP x PP plan bit-exact
# (tests/engine/test_empty_replica.py) and the coordinator's decisions for DP x PP
# (tests/adapt/test_pipeline_adaptation.py)
@pytest.mark.timeout(900)
def test_a_slow_device_of_a_dp_x_pp_job_is_planned_around_live_bit_exact(tmp_path):
    _, events = _pp2_run(tmp_path, 32, ["slow:rank=0,iter=15,factor=6"])
    replans = events_of(events, "replan")
    assert replans, [e for e in events if e["kind"] in ("fail_slow", "replan_skipped")]
    first = replans[0]
    assert first["trigger"]["kind"] == "fail_slow" and first["trigger"]["rank"] == 0
    assert first["restore"] == "live" and first["devices_after"] == [0, 1, 2, 3]
    assert first["counts_after"][0] < first["counts_after"][1], first
    applied = [e for e in events_of(events, "plan_applied") if "stages" in e]
    assert applied and applied[0]["iter"] > first["trigger"]["since_iter"]
    assert applied[0]["counts"] == first["counts_after"]
    assert events_of(events, "checkpoint_loaded") == []
    assert events_of(events, "recovery_start") == []


@pytest.mark.slow  # ~25 s; shadow takeovers are in CI elsewhere (tests/recovery/test_shadows.py)
@pytest.mark.timeout(1200)
def test_a_shadow_takeover_right_after_a_live_pipeline_replan_keeps_the_new_plan(tmp_path):
    faults = ["slow:rank=0,iter=15,factor=6", "kill:rank=3,iter=27,phase=update"]
    s, events = _pp2_run(tmp_path, 30, faults)
    replan = events_of(events, "replan")[0]
    applied = events_of(events, "plan_applied")
    assert applied[0]["iter"] < 27  # the switch came before the crash
    # The promoted shadows of the next generation start on the re-planned plan.
    assert applied[-1]["generation"] == 1 and applied[-1]["counts"] == replan["counts_after"]
    (crash,) = s["recoveries"]
    assert crash["mode"] == "inplace" and crash["shadow_level"] == 3


@pytest.mark.slow  # ~50 s (56 iterations twice); CI keeps the return's
# parts without processes: tests/detect/test_plan_model.py (the watch finds the return) and
# tests/adapt/test_pipeline_adaptation.py (the coordinator switches back)
@pytest.mark.timeout(1200)
def test_a_slow_device_of_a_dp_x_pp_job_gets_its_microbatches_back_when_healthy(tmp_path):
    # Rank 0 is 6x slower for iterations 15..29 (`until`). After the live switch the watch
    # warms up again on the new plan (12 iterations), then compares rank 0 with the holder of
    # its stage in replica 1 over 8 iterations.
    _, events = _pp2_run(tmp_path, 56, ["slow:rank=0,iter=15,factor=6,until=30"])
    slow, back = events_of(events, "replan")
    assert slow["trigger"]["kind"] == "fail_slow" and slow["trigger"]["rank"] == 0
    (ended,) = events_of(events, "slow_ended")
    (recovered,) = [e for e in events_of(events, "speed_recovered") if e["rank"] == 0]
    assert recovered["detected_at"] > ended["iter"] == 30
    assert (back["trigger"]["kind"], back["trigger"]["device"]) == ("speed_recovered", 0)
    assert back["restore"] == "live" and back["counts_after"] == [4, 4]
    first, second = [e for e in events_of(events, "plan_applied") if "stages" in e]
    assert first["counts"] == slow["counts_after"] and second["counts"] == [4, 4]
    assert recovered["detected_at"] < second["iter"] < 56
    assert (
        events_of(events, "checkpoint_loaded") == [] and events_of(events, "recovery_start") == []
    )


@pytest.mark.slow  # ~60 s (52 iterations twice); CI keeps its parts without the whole run:
# tests/engine/test_empty_replica.py (the [8, 0]-style plan and its probe, bit-exact, live
# switches both ways), tests/detect/test_plan_model.py (the watch finds the rank back from its
# probes) and tests/adapt/test_pipeline_adaptation.py (the coordinator empties and refills)
@pytest.mark.timeout(1200)
def test_an_emptied_replica_is_probed_and_gets_its_microbatches_back_when_healthy(tmp_path):
    # Rank 3 (replica 1's last stage) 20x slower for iterations 15..29: one micro-batch there
    # costs more than all eight on replica 0, so the plan empties replica 1 ([8, 0]). Its
    # ranks then compute nothing but a probe micro-batch every adapt.probe_every (4)
    # iterations; the watch finds rank 3 back at its peers' pace from the probes, and the
    # coordinator gives replica 1 its micro-batches back. Bit for bit the fault-free run.
    _, events = _pp2_run(tmp_path, 52, ["slow:rank=3,iter=15,factor=20,until=30"])
    slow, back = events_of(events, "replan")
    assert slow["trigger"]["rank"] == 3 and slow["counts_after"] == [8, 0], slow
    first, second = [e for e in events_of(events, "plan_applied") if "stages" in e]
    assert first["counts"] == [8, 0] and second["counts"] == [4, 4]
    (recovered,) = [e for e in events_of(events, "speed_recovered") if e["rank"] == 3]
    assert recovered["detected_at"] > 30 and second["iter"] > recovered["detected_at"]
    assert (back["trigger"]["kind"], back["trigger"]["device"]) == ("speed_recovered", 3)
    probes = [
        r["iter"]
        for r in read_jsonl(tmp_path / "timings.jsonl")
        if r["run"] == "faulty" and r["rank"] == 3 and r.get("probe")
    ]
    assert probes and all(first["iter"] <= i < second["iter"] and i % 4 == 0 for i in probes)
