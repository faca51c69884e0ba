"""`unbroken simulate --validate RUN_DIR`: predict a real run's ETTR and compare (issue 4, item 5).

Owns reading a run directory of `unbroken train`/`demo` (metrics.jsonl, events.jsonl,
summary.json; the format is the runtime's contract, see docs/simulator.md) into the simulator's
inputs, and the comparison. What is taken from the run: the fault-free iteration time (reference
run), the faulty run's healthy iteration time (steady overhead), the checkpoint cost and
interval, each recovery's measured initialization time (T_det + T_init) by recovery mode, and the
injection schedule (iteration and how far into it). What is predicted: where every failure lands
against the checkpoint schedule, the lost work and recomputation that follow, and the run's
elapsed time, hence its ETTR. The measured ETTR is never an input.
"""

from __future__ import annotations

import itertools
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from unbroken.errors import UserError
from unbroken.sim._load import read_run_log
from unbroken.sim.des import IterFailure, replay_iterations
from unbroken.sim.ettr import closed_form
from unbroken.sim.policy import FailureMix, KindCost, PolicyTerms

__all__ = ["Validation", "validate_run"]

# Recovery modes of the runtime that keep progress (no rollback to a checkpoint).
IN_PLACE_MODES = ("inplace", "in_place", "replan")
# Phases after the gradients are protected: an in-place recovery keeps the iteration's
# computation and finishes its update (Leto §5; the runtime's phases).
POST_COMPUTE_PHASES = ("sync", "update", "parity", "writeback", "marker", "boundary")
# Where in an iteration each phase sits, as a fraction of the iteration (used only when the
# injection event lacks `iter_t_start`).
PHASE_FRACTION = MappingProxyType(
    {"forward": 0.25, "backward": 0.6, "sync": 0.85, "update": 0.9, "boundary": 0.99}
)


@dataclass(kw_only=True, slots=True)
class Validation:
    """Predicted against measured ETTR of one real run."""

    run_dir: str
    measured_ettr: float
    predicted_ettr: float
    closed_form_ettr: float
    iterations: int
    t_iter_s: float
    omega: float
    ckpt_interval: int
    ckpt_s: float
    failures: list[dict[str, Any]] = field(default_factory=list)
    measured_wall_s: float = 0.0
    predicted_wall_s: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def error_points(self) -> float:
        """Predicted minus measured ETTR, in percentage points."""
        return (self.predicted_ettr - self.measured_ettr) * 100.0

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "run_dir": self.run_dir,
            "measured_ettr": self.measured_ettr,
            "predicted_ettr": self.predicted_ettr,
            "closed_form_ettr": self.closed_form_ettr,
            "error_points": self.error_points,
            "iterations": self.iterations,
            "t_iter_s": self.t_iter_s,
            "omega": self.omega,
            "ckpt_interval": self.ckpt_interval,
            "ckpt_s": self.ckpt_s,
            "measured_wall_s": self.measured_wall_s,
            "predicted_wall_s": self.predicted_wall_s,
            "failures": self.failures,
            "notes": self.notes,
        }


def _completed(metrics: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    done: dict[int, dict[str, Any]] = {}
    for m in metrics:
        done[m["iter"]] = m
    return done


def _wall(metrics: list[dict[str, Any]], through: int) -> float:
    return _completed(metrics)[through]["t_end"] - min(m["t_start"] for m in metrics)


def validate_run(run_dir: str | Path) -> Validation:
    """Predict the ETTR of the run in `run_dir` from its measured parts; compare with measured.

    Raises:
        UserError: missing files, no reference run, or a run that did not recover.
    """
    root = Path(run_dir)
    if not root.is_dir():
        raise UserError(f"{root}: not a directory")
    notes: list[str] = []
    ref, name, flt, f_events = _read_runs(root, notes)

    last = min(max(_completed(flt)), max(_completed(ref)))  # 0-based index
    iterations = last + 1
    ref_wall = _wall(ref, last)
    flt_wall = _wall(flt, last)
    measured = ref_wall / flt_wall
    t_iter = ref_wall / iterations
    a = _steady_iteration(root, flt, f_events)
    omega = a / t_iter - 1.0
    ckpt_s, interval = _checkpointing(root, f_events)
    failures, mean_init = _failures(root, flt, f_events, t_iter * (1.0 + omega), notes)
    terms = _measured_terms(name, t_iter, omega, ckpt_s, interval, mean_init)
    run = _replay(terms, failures, iterations, a)
    n = len(failures)
    if n:
        hof = sum(f["kind"] == "hof" for f in failures) / n
        cf = closed_form(terms, FailureMix(mttf_s=flt_wall / n, hof_ratio=hof)).ettr
    else:
        cf = 1.0 / (1.0 + omega + (ckpt_s / interval / t_iter if interval else 0.0))
    return Validation(
        run_dir=str(root),
        measured_ettr=measured,
        predicted_ettr=run.ettr,
        closed_form_ettr=cf,
        iterations=iterations,
        t_iter_s=t_iter,
        omega=omega,
        ckpt_interval=interval,
        ckpt_s=ckpt_s,
        failures=failures,
        measured_wall_s=flt_wall,
        predicted_wall_s=run.wall_s,
        notes=notes,
    )


def _measured_terms(
    name: str, t_iter: float, omega: float, ckpt_s: float, interval: int, mean_init: dict
) -> PolicyTerms:
    """The policy terms of the measured run: its iteration time, overhead, checkpointing and
    mean initialization per failure kind (a fail-slow costs what a fatal failure does)."""
    costs = {
        "hof": KindCost(detect_s=0.0, init_s=mean_init["hof"], lost_iters=0.5, rollback=False),
        "fatal": KindCost(
            detect_s=0.0,
            init_s=mean_init["fatal"],
            lost_iters=(interval / 2.0 if interval else 0.5),
            rollback=True,
        ),
    }
    costs["fail-slow"] = costs["fatal"]
    return PolicyTerms(
        policy=f"measured:{name}",
        applicable=True,
        reason="",
        t_iter_s=t_iter,
        omega=omega,
        t_ckpt_s=ckpt_s,
        interval=interval,
        usable_lag=0,  # the runtime's checkpoint save is synchronous: usable when it returns
        costs=costs,
    )


Records = list[dict[str, Any]]


def _read_runs(root: Path, notes: list[str]) -> tuple[Records, str, Records, Records]:
    """(reference metrics, name of the run with failures, its metrics, its events)."""
    metrics = read_run_log(root / "metrics.jsonl")
    events = read_run_log(root / "events.jsonl")
    ref = [m for m in metrics if m.get("run") == "reference"]
    runs = {m.get("run") for m in metrics} - {"reference"}
    if not ref or not runs:
        raise UserError(f"{root}: needs both a reference run and a run with failures")
    generations = sorted({m.get("generation", 0) for m in ref})
    if len(generations) > 1:
        # A fault-free reference that restarted (e.g. a spurious hang detection) is not a
        # reference; its last generation ran every iteration without interruption.
        ref = [m for m in ref if m.get("generation", 0) == generations[-1]]
        notes.append(
            f"the reference run restarted {len(generations) - 1} times; using its last generation"
        )
    name = "faulty" if "faulty" in runs else sorted(runs)[0]
    flt = [m for m in metrics if m.get("run") == name]
    f_events = [e for e in events if e.get("run") == name]
    return ref, name, flt, f_events


def _steady_iteration(root: Path, flt: Records, f_events: Records) -> float:
    """Steady iteration of the faulty run, from wall-clock spacing: the start-to-start time of
    consecutive iterations in one generation (gaps and bookkeeping included), less the
    checkpoint save an iteration recorded, over every pair no failure falls into. The
    checkpoint cost is what the saves recorded (the difference of spacings with and without
    a save measured it too, but on a shared machine with the noise of two small samples)."""
    plain = []
    ordered = sorted(flt, key=lambda m: m["t_start"])
    fault_times = [e["t"] for e in f_events if e["kind"] == "failure_injected"]
    for m, n in itertools.pairwise(ordered):
        clean = not any(m["t_start"] <= t <= n["t_start"] for t in fault_times)
        if clean and n["iter"] == m["iter"] + 1 and n.get("generation") == m.get("generation"):
            plain.append(n["t_start"] - m["t_start"] - (m.get("ckpt_s") or 0.0))
    if not plain:
        raise UserError(f"{root}: too few iterations to measure the iteration time")
    return statistics.fmean(plain)


def _checkpointing(root: Path, f_events: Records) -> tuple[float, int]:
    """(mean seconds of a checkpoint save, checkpoint interval; 0 when nothing was saved)."""
    saves = [e for e in f_events if e["kind"] == "checkpoint_saved" and e.get("iter", 0) > 0]
    ckpt_s = statistics.fmean(e["seconds"] for e in saves) if saves else 0.0
    interval_ev = [e for e in f_events if e["kind"] == "checkpoint_interval"]
    summary_path = root / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    if interval_ev:
        interval = int(interval_ev[-1]["interval"])
    else:
        interval = int(summary.get("ckpt_interval") or 0)
    if not saves:
        interval = 0
    return ckpt_s, interval


def _failures(
    root: Path, flt: Records, f_events: Records, steady_iter_s: float, notes: list[str]
) -> tuple[Records, dict[str, float]]:
    """Each injected failure (but fail-slows) with its recovery, and the mean measured
    initialization per failure kind (hof, fatal)."""
    injected = sorted(
        (e for e in f_events if e["kind"] == "failure_injected" and e.get("fault") != "slow"),
        key=lambda e: e["t"],
    )
    if any(e.get("fault") == "slow" for e in f_events if e["kind"] == "failure_injected"):
        notes.append("fail-slow injections are not replayed (their slowdown is not modelled)")
    done = sorted((e for e in f_events if e["kind"] == "recovery_done"), key=lambda e: e["t"])
    if len(done) < len(injected):
        raise UserError(
            f"{root}: {len(injected)} failures injected but {len(done)} recoveries completed"
        )
    t0 = min(m["t_start"] for m in flt)
    failures = []
    inits: dict[str, list[float]] = {"hof": [], "fatal": []}
    for inj, rec in zip(injected, done, strict=False):
        kind = "hof" if rec.get("mode") in IN_PLACE_MODES else "fatal"
        # Measured initialization: fault until training resumes (includes detection).
        if rec.get("init_s") is None:
            raise UserError(f"{root}: a recovery_done event lacks init_s")
        init = float(rec["init_s"])
        inits[kind].append(init)
        started = inj.get("iter_t_start")
        if started:
            frac = (inj["t"] - started) / steady_iter_s
        else:
            frac = PHASE_FRACTION.get(inj.get("phase", ""), 0.5)
        frac = min(1.0, max(0.0, frac))
        failures.append(
            {
                "t_s": inj["t"] - t0,
                "iteration": inj["iter"],
                "phase": inj.get("phase"),
                "fraction": frac,
                "kind": kind,
                "mode": rec.get("mode"),
                "init_s": init,
                "recompute_s": rec.get("recompute_s"),
            }
        )
    mean_init = {k: (statistics.fmean(v) if v else 0.0) for k, v in inits.items()}
    return failures, mean_init


def _replay(terms: PolicyTerms, failures: Records, iterations: int, steady_iter_s: float):
    """Replay the failures against the checkpoint schedule; sets each failure's
    `predicted_recompute_s` and returns the replayed run."""
    schedule = [
        IterFailure(
            f["iteration"] + 1,
            f["fraction"],
            f["kind"],
            keeps_in_flight=f["kind"] == "hof" and f["phase"] in POST_COMPUTE_PHASES,
        )
        for f in failures
    ]
    run = replay_iterations(terms, schedule, iterations)
    order = sorted(
        range(len(failures)), key=lambda i: (schedule[i].iteration, schedule[i].fraction)
    )
    for i, lost in zip(order, run.lost_each, strict=False):
        failures[i]["predicted_recompute_s"] = lost * steady_iter_s
    return run
