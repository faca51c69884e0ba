"""Recovery breakdown and ETTR from a run's event and metric logs (Leto §8.1 definitions).

One row per failure the recovery state machine handled (each `failure_detected` event), with
the injected fault behind it when there was one. For a failure at t_fault interrupting
iteration k (an injected fault's own time; for a real failure its last sign of life: the
agent's exit observation, or the last heartbeat of a hang): t_j is when training resumes (start
of the first iteration attempt after the failure), t_k when iteration k completes again, t_remain the
fault-free remaining time of iteration k at the failure (median healthy iteration time minus the
time iteration k had already run). Then detection = t_detected − t_fault, initialization
I = t_j − t_fault, recomputation R = t_k − t_j − t_remain, recovery = I + R.
ETTR = T_ref(i) / T_eval(i), both from the first iteration's start to iteration i's completion.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["RecoveryBreakdown", "analyze_run", "ettr", "wall_time"]


@dataclass(frozen=True, slots=True)
class RecoveryBreakdown:
    kind: str
    mode: str
    rank: int
    iteration: int
    phase: str
    detect_s: float
    init_s: float
    recompute_s: float
    total_s: float
    restored_iter: int | None
    shadow_level: int = 0
    """Level of the shadow trainers promoted for this recovery (0: processes restarted)."""
    shadows_ready: int = 0
    """How many of them had reached that level when promoted."""
    protected_again_s: float | None = None
    """Failure to every rank having a ready shadow again (the next generation's shadows all at
    their level); None without shadows or when the run ended first."""
    fault: str = ""
    """The injected fault's kind (kill, hang, exception, pageloss, ckptcorrupt), "" for a
    failure nobody injected; `kind` is its class (hof: the process failed, the hardware did
    not)."""
    injected: bool = True
    """False for a real failure: its time is its last sign of life (the agent sees an exit
    within a tick; a hang was silent for its timeout), so `detect_s` is that silence."""
    cause: str = ""
    """How it was detected: exit, hang (`unbroken.detect.FailStopCause`)."""
    detected_t: float = 0.0
    """When it was detected (its `failure_detected` event's `t_detected`)."""
    node: int | None = None
    """The lost node, for a node loss (its ranks all failed at once)."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _completed(metrics: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Last completed attempt of every iteration."""
    out: dict[int, dict[str, Any]] = {}
    for m in metrics:
        out[m["iter"]] = m
    return out


def wall_time(metrics: list[dict[str, Any]], through_iter: int | None = None) -> float:
    """Seconds from the first iteration's start to `through_iter`'s (last) completion."""
    if not metrics:
        return 0.0
    done = _completed(metrics)
    last = max(done) if through_iter is None else through_iter
    return done[last]["t_end"] - min(m["t_start"] for m in metrics)


def ettr(reference: list[dict[str, Any]], evaluated: list[dict[str, Any]]) -> float:
    """T_ref(i) / T_eval(i) for the evaluated run's last completed iteration i."""
    if not reference or not evaluated:
        return 0.0
    last = min(max(_completed(evaluated)), max(_completed(reference)))
    return wall_time(reference, last) / wall_time(evaluated, last)


def healthy_iter_s(metrics: list[dict[str, Any]]) -> float:
    times = [m["iter_s"] for m in metrics if not m.get("ckpt_s")]
    return statistics.median(times) if times else 0.0


_HOF_FAULTS = ("kill", "hang", "exception", "pageloss", "ckptcorrupt")


def _failures(events: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any] | None]]:
    """Each detected failure (`failure_detected`, one per recovery the state machine made, or
    `node_lost`: a whole node gone) with the injected fault that caused it, if one fired since
    the previous detection."""
    detected = sorted(
        (e for e in events if e["kind"] in ("failure_detected", "node_lost")), key=lambda e: e["t"]
    )
    injected = sorted(
        (e for e in events if e["kind"] == "failure_injected" and e.get("fault") != "slow"),
        key=lambda e: e["t"],
    )
    out, prev = [], float("-inf")
    for det in detected:
        inj = [e for e in injected if prev < e["t"] <= det["t"]]
        out.append((det, inj[-1] if inj else None))
        prev = det["t"]
    return out


def _origin(
    det: dict[str, Any], inj: dict[str, Any] | None, metrics: list[dict[str, Any]]
) -> tuple[float, int, str, float]:
    """(t_fault, interrupted iteration, phase, seconds it had run) of one failure. An injected
    fault knows its own time; a real one is dated by its last sign of life (an exit is seen by
    the agent within a tick; a hang was silent for `silent_s` before it was declared)."""
    if inj is not None:
        t_fault = inj["t"]
        return t_fault, inj["iter"], inj["phase"], t_fault - inj.get("iter_t_start", t_fault)
    t_fault = det.get("t_detected", det["t"]) - (det.get("silent_s") or 0.0)
    before = [m for m in metrics if m["t_end"] <= t_fault]
    k = det.get("iter", -1)
    if k is None or k < 0:
        k = before[-1]["iter"] + 1 if before else 0
    ran = t_fault - before[-1]["t_end"] if before else 0.0
    return t_fault, k, det.get("phase") or "", ran


def _resumed(
    metrics: list[dict[str, Any]],
    ready: dict[str, Any] | None,
    t_fault: float,
    k: int,
    healthy: float,
    ran: float,
) -> tuple[float, float] | None:
    """(t_j, recomputation seconds) of a failure at `t_fault` in iteration `k`, or None when
    the run never recovered from it."""
    after = [m for m in metrics if m["t_start"] > t_fault]
    if ready is not None and ready.get("restored_iter", -1) > k and after:
        # In-place recovery finished iteration k's update while repairing: training resumed
        # past it, nothing is recomputed.
        return ready["t"], 0.0
    redone = next((m for m in after if m["iter"] == k), None)
    if redone is None:
        if any(m["iter"] > k for m in after):
            # Training went on past k, whose row was never written: a stop cut the generation
            # that finished k before its rank 0 logged it (a lost node back at once: the
            # survivors' generation is stopped for the larger world), and the next one resumed
            # in place after k. Recovered when training ran again; nothing recomputed.
            return (ready["t"] if ready is not None else after[0]["t_start"]), 0.0
        return None  # not recovered (the summary counts it as unrecovered)
    t_j = after[0]["t_start"]
    t_remain = max(0.0, healthy - ran)
    return t_j, max(0.0, redone["t_end"] - t_j - t_remain)


def _shadows(
    events: list[dict[str, Any]], t_fault: float, ready: dict[str, Any] | None
) -> tuple[dict[str, Any] | None, float | None]:
    """The promotion that served a recovery (None: processes restarted) and how long after the
    failure every rank had a ready shadow again (None: never, or no shadows).

    The promotion of the generation the recovery's first ready trainer belongs to, not one
    logged before that trainer's `trainer_ready`: the coordinator logs `shadows_promoted` when
    it reads the agent's `Started`, and on a loaded machine a promoted shadow was once ready
    (0.1-0.2 s after its promotion) before that, so the demo's takeover read as none."""
    promoted = next(
        (
            e
            for e in events
            if e["kind"] == "shadows_promoted" and e["t"] >= t_fault and _serves(e, ready)
        ),
        None,
    )
    if promoted is None:
        return None, None
    n_ranks = len({e["rank"] for e in events if e["kind"] == "shadow_ready"})
    nxt = [
        e["t"]
        for e in events
        if e["kind"] == "shadow_ready" and e["generation"] == promoted["generation"] + 1
    ]
    again = max(nxt) - t_fault if n_ranks and len(nxt) >= n_ranks else None
    return promoted, again


def _serves(promoted: dict[str, Any], ready: dict[str, Any] | None) -> bool:
    """Whether a promotion after the failure is the one its first ready trainer came from."""
    if ready is None:
        return True
    if "generation" in ready and "generation" in promoted:
        return promoted["generation"] == ready["generation"]
    return promoted["t"] <= ready["t"]  # logs from before events named their generation


def _rank(det: dict[str, Any], inj: dict[str, Any] | None) -> int:
    """The failed rank; -1 for a node lost with all its ranks."""
    if det.get("rank") is not None:
        return det["rank"]
    return inj["rank"] if inj is not None and inj.get("rank") is not None else -1


def analyze_run(
    metrics: list[dict[str, Any]],
    events: list[dict[str, Any]],
    healthy_s: float | None = None,
) -> list[RecoveryBreakdown]:
    """Per-failure recovery breakdown of one run (its own metrics and events): one row per
    failure the state machine recovered from, injected or not."""
    healthy = healthy_s if healthy_s is not None else healthy_iter_s(metrics)
    out = []
    for det, inj in _failures(events):
        t_fault, k, phase, ran = _origin(det, inj, metrics)
        ready = next(
            (e for e in events if e["kind"] == "trainer_ready" and e["t"] >= t_fault), None
        )
        resumed = _resumed(metrics, ready, t_fault, k, healthy, ran)
        if resumed is None:
            continue
        t_j, recompute = resumed
        promoted, protected_again = _shadows(events, t_fault, ready)
        fault = inj.get("fault", "") if inj is not None else ""
        if det["kind"] == "node_lost" and not fault:
            fault = "node_lost"
        t_detected = det.get("t_detected", det["t"])
        out.append(
            RecoveryBreakdown(
                kind="hof" if inj is None or fault in _HOF_FAULTS else fault,
                fault=fault,
                injected=inj is not None,
                cause=det.get("cause", ""),
                mode=ready.get("recovery", "unknown") if ready else "unknown",
                rank=_rank(det, inj),
                iteration=k,
                phase=phase,
                detect_s=t_detected - t_fault,
                init_s=t_j - t_fault,
                recompute_s=recompute,
                total_s=t_j - t_fault + recompute,
                restored_iter=ready.get("restored_iter") if ready else None,
                shadow_level=promoted["level"] if promoted else 0,
                shadows_ready=promoted.get("ready", 0) if promoted else 0,
                protected_again_s=protected_again,
                detected_t=t_detected,
                node=det.get("node") if det["kind"] == "node_lost" else None,
            )
        )
    return out
