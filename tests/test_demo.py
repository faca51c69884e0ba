"""`unbroken demo --quick`: the README's main job, end to end, as a user runs it."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys

import pytest


def _detector_trace(out) -> str:
    """What the fail-slow watch saw, for the failure message."""
    lines = []
    for name in ("events.jsonl", "metrics.jsonl"):
        for row in map(json.loads, (out / name).read_text().splitlines()):
            if row.get("run") != "faulty":
                continue
            if name == "metrics.jsonl":
                lines.append(f"iter {row['iter']} gen {row['generation']} {row['iter_s']:.3f}s")
            elif row["kind"] in ("change_point", "fail_slow", "detector_disabled", "slow_active"):
                lines.append(json.dumps(row))
    return "\n".join(lines)


def _shadow_trace(out) -> str:
    """The faulty run's shadow and generation events, one line each: what a failed takeover
    assertion shows."""
    kinds = ("shadow", "trainer_ready", "failure_", "recovery_", "generation", "memory", "reclaim")
    lines = []
    for line in (out / "events.jsonl").read_text().splitlines():
        e = json.loads(line)
        if e.get("run") == "faulty" and any(k in e["kind"] for k in kinds):
            lines.append(line[:300])
    return "\n".join(lines)


def _takeovers_expected(out, summary) -> list[bool]:
    """For each recovery (in the summary's order): whether every rank's shadow for the next
    generation had reported ready before the failure was injected."""
    events = [e for e in map(json.loads, (out / "events.jsonl").read_text().splitlines())]
    events = [e for e in events if e.get("run") == "faulty"]
    out_list = []
    for rec in summary["recoveries"]:
        (fault,) = [
            e
            for e in events
            if e["kind"] == "failure_injected"
            and (e["rank"], e["iter"]) == (rec["rank"], rec["iteration"])
        ]
        running = max(
            e["generation"] for e in events if e["kind"] == "trainer_ready" and e["t"] < fault["t"]
        )
        ready = {
            e["rank"]
            for e in events
            if e["kind"] == "shadow_ready"
            and e["generation"] == running + 1
            and e["t"] < fault["t"]
        }
        out_list.append(len(ready) == summary["world_size"])
    return out_list


def _healthy_drift(out) -> float:
    """How much slower the faulty run's healthy iterations were than the reference's same
    iterations: the median over iterations before the slow rank's fault that are neither the
    first of the run nor the first of a new generation (both carry start-up work), like with
    like. The faulty run's own median is no measure of this: a third of its iterations run
    beside the slow rank."""
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    (slow_from,) = [
        e["iter"]
        for e in events
        if e.get("run") == "faulty" and e["kind"] == "failure_injected" and e["fault"] == "slow"
    ]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    ref = {r["iter"]: r["iter_s"] for r in rows if r.get("run") == "reference"}
    faulty = sorted(
        (r["iter"], r["generation"], r["iter_s"]) for r in rows if r.get("run") == "faulty"
    )
    healthy = [
        (it, t)
        for (it, gen, t), (prev_it, prev_gen, _) in zip(faulty[1:], faulty, strict=False)
        if it < slow_from and gen == prev_gen and it == prev_it + 1 and it in ref
    ]
    assert len(healthy) >= 8, healthy
    return statistics.median(t for _, t in healthy) / statistics.median(
        ref[it] for it, _ in healthy
    )


def test_demo_quick_recovers_in_place_exactly_and_re_plans_around_the_slow_rank(tmp_path):
    out = tmp_path / "demo"
    r = subprocess.run(
        [sys.executable, "-m", "unbroken", "demo", "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["bit_exact"] is True
    assert s["final_state_hash"] == s["reference_state_hash"]
    assert s["failures_injected"] == s["failures_recovered"] == 3
    assert {rec["mode"] for rec in s["recoveries"]} == {"inplace"}
    # A failure that found every rank's shadow ready is taken over by all of them at the
    # configured level (L3), never by fresh processes.
    expected = _takeovers_expected(out, s)
    assert any(expected), "no failure found every shadow ready: nothing checks the takeover"
    for rec, all_ready in zip(s["recoveries"], expected, strict=True):
        if all_ready:
            got = (rec["shadow_level"], rec["shadows_ready"])
            assert got == (3, s["world_size"]), (rec, _shadow_trace(out))
    # Every generation after the first restored in place (three recoveries, and the planned
    # stop of a re-plan that takes the slow device out of the world), and says how long
    # attaching the retained state and restoring took.
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    started = [e for e in events if e.get("run") == "faulty" and e["kind"] == "trainer_ready"]
    ready = [e for e in started if e["recovery"] == "inplace"]
    assert [e["generation"] for e in ready] == [e["generation"] for e in started][1:]
    assert len(ready) >= 3, _shadow_trace(out)
    assert all(0 <= e["map_s"] <= e["attach_s"] and e["restore_s"] >= 0 for e in ready), ready
    parts = ("model_and_state", "updater", "trainer")
    assert all(sum(e["build_s"][k] for k in parts) <= e["attach_s"] for e in ready), ready
    # ETTR = T_ref / T_faulty over the same iterations. The two runs drift apart on a busy
    # machine, so the bound is in each run's own healthy iteration: the faulty run (three
    # recoveries, a 3x slow rank for its last 16 iterations) lasts more of its iterations than
    # the fault-free one does of its own.
    assert s["ettr"] == pytest.approx(s["reference_wall_s"] / s["faulty_wall_s"], rel=1e-9)
    drift = _healthy_drift(out)
    assert 0 < s["ettr"] * drift < 1, (s["ettr"], drift)
    assert [f["rank"] for f in s["fail_slow"]] == [3], _detector_trace(out)
    # ... and re-planned around (adapt is on in the demo): device 3 keeps fewer micro-batches
    # or leaves the world (its step waited for at every boundary: [Note: step lead]), the
    # others take them, the global batch stays, and the run is still bit-exact.
    (replan,) = s["replans"]
    assert replan["trigger"]["kind"] == "fail_slow" and replan["trigger"]["rank"] == 3
    before, after = replan["counts_before"], replan["counts_after"]
    kept = dict(zip(replan["devices_after"], after, strict=True)).get(3, 0)
    assert kept < before[3] and sum(after) == sum(before), replan
    assert replan["measured_after"] is not None, replan
    assert "re-plan (fail_slow)" in r.stderr and "re-plan at iteration" in r.stdout
    for name in ("events.jsonl", "metrics.jsonl", "plot.png", "report.html"):
        assert (out / name).stat().st_size > 0
    assert "bit-exact: True" in r.stdout
    assert f"report: {out / 'report.html'}" in r.stdout


@pytest.mark.slow  # ~80 s: the multi-node paths run in the CI tier in tests/launch/test_multinode.py
@pytest.mark.timeout(600)
def test_demo_on_two_nodes_survives_the_loss_of_node_1(tmp_path):
    out = tmp_path / "demo"
    cmd = [sys.executable, "-m", "unbroken", "demo", "--quick", "--nodes", "2", "--no-report"]
    proc = subprocess.run(
        [*cmd, "--out", str(out), "--json"], capture_output=True, text=True, timeout=580
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    assert summary["bit_exact"] is True
    node = [r for r in summary["recoveries"] if r.get("node") is not None]
    assert [(r["fault"], r["node"], r["mode"]) for r in node] == [("nodeloss", 1, "inplace")]
    assert summary["failures_recovered"] == summary["failures_detected"] == 4
    joined = [
        e
        for e in map(json.loads, (out / "events.jsonl").read_text().splitlines())
        if e["kind"] == "agent_joined" and e["run"] == "faulty"
    ]
    assert sorted((e["node"], e["host"] == "127.0.0.2") for e in joined) == [(0, False), (1, True)]
