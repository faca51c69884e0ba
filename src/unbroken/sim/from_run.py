"""`unbroken simulate --profile-from RUN_DIR`: a per-stage profile from a real run (App. C.1 (a)).

Owns turning the output dir of `unbroken train`/`demo` into the profile JSON that `profile.py`
reads, and the run's measured iteration time that the profile's prediction is compared with.
Inputs: `timings.jsonl` (every rank's timings of every iteration, the runtime's fail-slow
records), `metrics.jsonl`, `events.jsonl`, `config.json` and `summary.json`. The run profiled is
the fault-free `reference` when there is one (T_iter is the iteration without fault tolerance),
else the run with the most records; the first iteration of every generation is left out
(warm-up), and every statistic is a median over the remaining iterations, as the machine that
ran the job may have been shared.

Plan runs (tp or pp > 1) record every compute action per rank (`StageTiming`), so each term
of T_iter = T_pipeline + T_sync + T_update is measured separately and the prediction is
independent of the measured iteration time. Data-parallel runs record per-micro-batch times up
to the gradient all-reduce (`RankTiming`) but nothing after it: their `update_s` is fitted as
the rest of the measured iteration, so their prediction matches the measurement by
construction (named in `fitted`). The profile's `derived` table says how each value was
obtained. Reads files only; never imports torch.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from unbroken.errors import UserError
from unbroken.sim._load import read_run_log
from unbroken.sim._run_terms import (
    Iteration,
    dp_terms,
    ettr_terms,
    plan_terms,
    spacing,
    steady_iterations,
)
from unbroken.sim.itertime import IterationBreakdown, iteration_time
from unbroken.sim.profile import profile_from_dict

__all__ = ["RunProfile", "profile_from_run"]


@dataclass(kw_only=True, slots=True)
class RunProfile:
    """The profile derived from one run, its prediction and the run's measurement."""

    run_dir: str
    run: str
    kind: str
    """"plan" (per-action timings) or "data-parallel" (per-micro-batch timings)."""
    iterations: int
    """Steady iterations the statistics are taken over."""
    profile: dict[str, Any]
    """The profile JSON object (`profile.py`'s format)."""
    breakdown: IterationBreakdown
    """T_iter and its terms as the simulator computes them from `profile`."""
    measured_iter_s: float | None
    """Median iteration as the runtime's `run_iteration` ran it (slowest rank); None when the
    run's records do not give it (data-parallel)."""
    measured_spacing_s: float
    """Median start-to-start time of consecutive iterations (metrics.jsonl): the above plus the
    runtime's per-iteration bookkeeping (state hash, logs)."""
    fitted: list[str] = field(default_factory=list)
    """Profile fields fitted to the measured iteration time (then the comparison is not a test)."""

    @property
    def predicted_iter_s(self) -> float:
        """T_iter predicted from the profile."""
        return self.breakdown.iter_s

    @property
    def reference_s(self) -> float:
        """The measured time the prediction models: `run_iteration` where recorded."""
        return self.measured_iter_s or self.measured_spacing_s

    @property
    def error(self) -> float:
        """Predicted / measured - 1."""
        return self.predicted_iter_s / self.reference_s - 1.0

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form (the profile itself is written separately)."""
        b = self.breakdown
        return {
            "run_dir": self.run_dir,
            "run": self.run,
            "kind": self.kind,
            "iterations": self.iterations,
            "predicted_iter_s": self.predicted_iter_s,
            "pipeline_s": b.pipeline_s,
            "sync_s": b.sync_s,
            "update_s": b.update_s,
            "measured_iter_s": self.measured_iter_s,
            "measured_spacing_s": self.measured_spacing_s,
            "error": self.error,
            "error_vs_spacing": self.predicted_iter_s / self.measured_spacing_s - 1.0,
            "fitted": self.fitted,
        }


def _choose_run(timings: list[dict[str, Any]], root: Path) -> str:
    counts: dict[str, int] = defaultdict(int)
    for t in timings:
        counts[str(t.get("run", ""))] += 1
    if not counts:
        raise UserError(f"{root / 'timings.jsonl'}: no timing records")
    return "reference" if "reference" in counts else max(counts, key=lambda r: counts[r])


# Long: reads and checks the run's four files in turn, then assembles the profile.
def profile_from_run(run_dir: str | Path) -> RunProfile:
    """Derive a per-stage profile from the run in `run_dir` and predict its iteration time.

    Raises:
        UserError: not a run dir, no timings (a runtime too old to write them), or too few
            steady iterations.
    """
    root = Path(run_dir)
    if not root.is_dir():
        raise UserError(f"{root}: not a directory")
    timings = read_run_log(root / "timings.jsonl")
    metrics = read_run_log(root / "metrics.jsonl")
    events = read_run_log(root / "events.jsonl")
    config_path = root / "config.json"
    if not config_path.exists():
        raise UserError(f"{config_path}: missing (is this an `unbroken train`/`demo` output dir?)")
    config = json.loads(config_path.read_text())
    summary_path = root / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}

    run = _choose_run(timings, root)
    faults = {e["iter"] for e in events if e.get("run") == run and e["kind"] == "failure_injected"}
    steady: list[Iteration] = steady_iterations(
        [t for t in timings if t.get("run") == run], skip=faults
    )
    if len(steady) < 2:
        raise UserError(f"{root}: run {run!r} has {len(steady)} steady iterations; need >= 2")
    gaps = spacing(metrics, run, faults)
    if not gaps:
        raise UserError(f"{root}: run {run!r}: too few consecutive iterations in metrics.jsonl")
    measured_spacing = statistics.median(gaps)

    fitted: list[str] = []
    if "compute" in steady[0][min(steady[0])]:
        kind = "plan"
        fields, derived, measured_iter = plan_terms(steady)
    else:
        kind = "data-parallel"
        fields, derived = dp_terms(steady, measured_spacing)
        measured_iter = None
        fitted.append("update_s")
    ettr, ettr_derived = ettr_terms(config, summary, events, metrics, run)
    profile = {
        **fields,
        **ettr,
        "derived": {**derived, **ettr_derived},
        "measured": {
            "run_dir": str(root),
            "run": run,
            "steady_iterations": len(steady),
            "iter_s": measured_iter,
            "spacing_s": measured_spacing,
        },
    }
    inputs, _ = profile_from_dict(profile, f"{root} (derived profile)")
    return RunProfile(
        run_dir=str(root),
        run=run,
        kind=kind,
        iterations=len(steady),
        profile=profile,
        breakdown=iteration_time(inputs),
        measured_iter_s=measured_iter,
        measured_spacing_s=measured_spacing,
        fitted=fitted,
    )
