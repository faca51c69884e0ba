"""Recovery breakdown from event and metric logs (Leto §8.1), on hand-built logs."""

from __future__ import annotations

from unbroken.metrics.analysis import analyze_run


def _logs(second_shadow_ready: bool):
    metrics = [
        {"iter": i, "t_start": float(i), "t_end": i + 0.9, "iter_s": 0.9, "generation": 0}
        for i in range(5)
    ]
    metrics += [{"iter": 6, "t_start": 10.6, "t_end": 11.5, "iter_s": 0.9, "generation": 1}]
    events = [
        {"kind": "shadow_ready", "generation": 1, "rank": 0, "t": 2.0},
        {"kind": "shadow_ready", "generation": 1, "rank": 1, "t": 2.1},
        {
            "kind": "failure_injected",
            "fault": "kill",
            "rank": 1,
            "iter": 5,
            "phase": "update",
            "t": 10.0,
            "iter_t_start": 9.5,
        },
        {"kind": "failure_detected", "t": 10.05},
        {"kind": "shadows_promoted", "generation": 1, "level": 3, "ready": 2, "t": 10.1},
        {"kind": "trainer_ready", "recovery": "inplace", "restored_iter": 6, "t": 10.5},
        {"kind": "shadow_ready", "generation": 2, "rank": 0, "t": 11.0},
    ]
    if second_shadow_ready:
        events.append({"kind": "shadow_ready", "generation": 2, "rank": 1, "t": 12.0})
    return metrics, events


def test_breakdown_of_an_l3_takeover_reports_when_every_rank_has_a_shadow_again():
    (r,) = analyze_run(*_logs(second_shadow_ready=True))
    assert (r.mode, r.shadow_level, r.shadows_ready) == ("inplace", 3, 2)
    assert abs(r.detect_s - 0.05) < 1e-9
    assert abs(r.init_s - 0.5) < 1e-9 and r.recompute_s == 0.0  # update finished in place
    assert abs(r.protected_again_s - 2.0) < 1e-9  # the last of the next shadows, from the fault


def test_protection_not_restored_before_the_run_ended_is_none():
    (r,) = analyze_run(*_logs(second_shadow_ready=False))
    assert r.protected_again_s is None


def test_a_takeover_logged_after_its_promoted_trainer_was_ready_still_counts():
    """The coordinator logs the promotion when it reads the agent's message; on a loaded
    machine the promoted trainer's `trainer_ready` came first (the demo's CI failure, stop
    29). The promotion of the ready trainer's generation serves the recovery; one of another
    generation does not."""
    metrics, events = _logs(second_shadow_ready=True)
    (ready,) = [e for e in events if e["kind"] == "trainer_ready"]
    ready["generation"] = 1
    (promoted,) = [e for e in events if e["kind"] == "shadows_promoted"]
    promoted["t"] = ready["t"] + 0.3
    (r,) = analyze_run(metrics, events)
    assert (r.shadow_level, r.shadows_ready) == (3, 2)
    promoted["generation"] = 2
    (r,) = analyze_run(metrics, events)
    assert (r.shadow_level, r.shadows_ready) == (0, 0)
