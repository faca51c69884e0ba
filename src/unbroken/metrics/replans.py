"""The record of a run's re-plans (issue 18), from its event and metric logs: one row per
executed `replan`, with where it took effect and what it did to the iteration time.

A row joins the coordinator's `replan` event (trigger, placement and devices before and after,
the planner's prediction, its seconds) with the ranks' `plan_applied` of the same epoch (the
first iteration on the new placement, the boundary switch's seconds) and measures, from the
metrics, the median iteration time and tokens/s over the `WINDOW` iterations before that
iteration and over the `WINDOW` after it (the first iteration on the new placement is left
out: it pays the switch or the restart). For a re-plan around a lost device the
reconfiguration is split by the run's events: stop (the failed generation torn down), start
(new trainers up to `trainer_ready`: processes, group, retained state attached and repaired),
repair (the slowest rank's in-place repair, part of start) — and `reconfig_s`, from the
detection to the first iteration on the survivors (detection excluded). Every row with a new
generation also gives `communicators_s` (rank 0 forming the new generation's process group,
part of start: the group rebuilt without the excluded devices) and `shadow_s` (from the
generation's start to the last rank's shadow for the generation after it being ready: the
shadows re-prepared for the new layout, beside the new trainers; None without shadows). A
lost device planned around by moving the state (a TP group shrunk to its peer) also gives the
move's steps (`move_s`, `transfer_s`, `moved_bytes`).

A re-plan that moves layers (`restore` "reshard") is split the same way from the planned stop
the coordinator ordered when it decided it: stop, start (up to `trainer_ready`, the move
included), move (the slowest rank's copy out of retained memory, build of the new plan's
executor, exchange and parity, `state_moved`) and `reconfig_s` to the first iteration on the
new plan. So is one that changes the world at a planned stop without moving layers — a slow
device taken out of a data-parallel world, or devices back in it (a re-admission: its start
includes filling the returned rank from a replica) — without the move.

The fault-free reference does not replay the plan changes: a job that re-plans reduces its
gradients in micro-batch order ([Note: ordered reduction] in `unbroken.train.ordered`), so
its bits do not depend on the placement and it is audited against the original plan.
"""

from __future__ import annotations

import statistics
from typing import Any

__all__ = ["WINDOW", "replan_records"]

WINDOW = 5
"""Iterations measured on each side of a re-plan."""


def _last_rows(metrics: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    rows: dict[int, dict[str, Any]] = {}
    for m in metrics:
        rows[m["iter"]] = m
    return rows


def _measure(rows: dict[int, dict[str, Any]], iters: range) -> dict[str, float | None]:
    got = [rows[i] for i in iters if i in rows]
    if not got:
        return {"iter_s": None, "tokens_per_s": None}
    return {
        "iter_s": statistics.median(m["iter_s"] - m.get("ckpt_s", 0.0) for m in got),
        "tokens_per_s": statistics.median(m["tokens_per_s"] for m in got),
    }


def _state_t(events: list[dict[str, Any]], new: str, after: float) -> float | None:
    return next(
        (e["t"] for e in events if e["kind"] == "state" and e["new"] == new and e["t"] >= after),
        None,
    )


def _move_steps(events: list[dict[str, Any]], ready: dict[str, Any] | None) -> dict:
    """The slowest rank's move of the state in the generation `ready` started (`state_moved`),
    the slowest exchange, and the bytes every rank received."""
    gen = ready["generation"] if ready else None
    moved = [e for e in events if e["kind"] == "state_moved" and e["generation"] == gen]
    if not moved:
        return {"move_s": None, "transfer_s": None, "moved_bytes": None}
    steps = ("copy_s", "build_s", "transfer_s", "parity_s")
    return {
        "move_s": max(sum(e[k] for k in steps) for e in moved),
        "transfer_s": max(e["transfer_s"] for e in moved),
        "moved_bytes": sum(e["bytes_in"] for e in moved),
    }


def _rebuilt(events: list[dict[str, Any]], ready: dict[str, Any] | None, t0: float) -> dict:
    """The group and shadow steps of the generation `ready` started (module docstring)."""
    if ready is None:
        return {"communicators_s": None, "shadow_s": None}
    nxt = ready["generation"] + 1
    shadows = [e["t"] for e in events if e["kind"] == "shadow_ready" and e["generation"] == nxt]
    return {
        "communicators_s": ready.get("communicators_s"),
        "shadow_s": (max(shadows) - t0) if shadows else None,
    }


def _reconfig(
    events: list[dict[str, Any]], metrics: list[dict[str, Any]], replan: dict[str, Any]
) -> dict[str, float | None]:
    """Seconds of a re-plan around a lost device, by step (see the module docstring)."""
    detected = [e for e in events if e["kind"] == "failure_detected" and e["t"] <= replan["t"]]
    if not detected:
        return {}
    t_det = detected[-1].get("t_detected", detected[-1]["t"])
    stopping = _state_t(events, "stopping", t_det - 1.0)
    restarting = _state_t(events, "restarting", t_det)
    ready = next(
        (e for e in events if e["kind"] == "trainer_ready" and e["t"] >= replan["t"]), None
    )
    repairs = [
        e["total_ms"] / 1e3
        for e in events
        if e["kind"] == "inplace_repair"
        and ready is not None
        and e["t"] <= ready["t"] + 5
        and e["t"] >= replan["t"]
    ]
    first = next((m for m in metrics if m["t_start"] >= replan["t"]), None)
    return {
        "stop_s": (restarting - stopping) if stopping and restarting else None,
        "start_s": (ready["t"] - replan["t"]) if ready else None,
        "repair_s": max(repairs) if repairs else None,
        "reconfig_s": (first["t_start"] - t_det) if first else None,
        **(_move_steps(events, ready) if replan.get("restore") == "reshard" else {}),
        **_rebuilt(events, ready, replan["t"]),
    }


def _moved(
    events: list[dict[str, Any]], metrics: list[dict[str, Any]], replan: dict[str, Any]
) -> dict[str, float | None]:
    """Seconds of a re-plan at a planned stop (layers moved, or the world changed without a
    move), by step (see the module docstring)."""
    stops = [
        e
        for e in events
        if e["kind"] == "state" and e["new"] == "stopping" and e["t"] <= replan["t"]
    ]
    if not stops:
        return {}
    t_stop = stops[-1]["t"]
    ready = next(
        (e for e in events if e["kind"] == "trainer_ready" and e["t"] >= replan["t"]), None
    )
    first = next((m for m in metrics if m["t_start"] >= replan["t"]), None)
    return {
        "stop_s": replan["t"] - t_stop,
        "start_s": (ready["t"] - replan["t"]) if ready else None,
        **_move_steps(events, ready),
        "reconfig_s": (first["t_start"] - t_stop) if first else None,
        **_rebuilt(events, ready, replan["t"]),
    }


def _planned_stop(trigger: dict[str, Any]) -> bool:
    """A re-plan the coordinator made at a planned stop without moving layers: a slow device
    taken out of the world, or devices back in it."""
    return bool(trigger.get("excluded")) or trigger["kind"] == "devices_returned"


def replan_records(
    events: list[dict[str, Any]], metrics: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """One row per executed re-plan of a run (its own events and metrics), in order."""
    rows = _last_rows(metrics)
    out = []
    for r in (e for e in events if e["kind"] == "replan"):
        applied = next(
            (e for e in events if e["kind"] == "plan_applied" and e["epoch"] == r["epoch"]), None
        )
        it = applied["iter"] if applied else None
        row: dict[str, Any] = {
            "epoch": r["epoch"],
            "trigger": r["trigger"],
            "iter": it,
            "devices_before": r["devices_before"],
            "devices_after": r["devices_after"],
            "counts_before": r["counts_before"],
            "counts_after": r["counts_after"],
            "predicted_before_s": r.get("predicted_before_s"),
            "predicted_after_s": r.get("predicted_after_s"),
            "plan_s": r["plan_s"],
            "switch_s": applied.get("switch_s") if applied else None,
            "restore": r.get("restore"),
        }
        after = r.get("after")
        if isinstance(after, list) and all(isinstance(g, dict) and "tp" in g for g in after):
            row["tp_after"] = [g["tp"] for g in after]  # a plan job's stages' TP degrees
        if it is not None:
            row["measured_before"] = _measure(rows, range(it - WINDOW, it))
            row["measured_after"] = _measure(rows, range(it + 1, it + 1 + WINDOW))
        if r["trigger"]["kind"] == "device_lost":
            row.update(_reconfig(events, metrics, r))
        elif r.get("restore") == "reshard" or _planned_stop(r["trigger"]):
            row.update(_moved(events, metrics, r))
        out.append(row)
    return out
