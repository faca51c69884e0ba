"""What the HTML run report shows, as plain data: read from a run directory's files
(`docs/outputs.md`) and shaped for `report_charts` and `report_html`. No plotting, no HTML.

The report never recomputes what `summary.json` states (the comparison table, the recoveries,
ETTR, bit-exactness): it reads the summary and the event log as the runtime wrote them. The
recovery bars split each recovery's `total_s` with the `inplace_repair` events of the
generation that repaired it (the slowest rank's localize and reconstruct, ranks repair in
parallel); what remains of the initialization is shown as `init`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from unbroken.metrics.log import read_jsonl

__all__ = [
    "SEGMENTS",
    "DetectorSeries",
    "Marker",
    "RecoveryBar",
    "RunData",
    "markers",
    "read_run",
    "recovery_bars",
]

SEGMENTS = ("detect", "init", "localize", "reconstruct", "recompute")
"""Parts of a recovery's time, in the order they happen."""

REPLAN_KINDS = ("replan", "plan_changed")
"""Event kinds of a re-plan (a new parallel plan around survivors), marked on the timelines."""


@dataclass(frozen=True, slots=True)
class DetectorSeries:
    """The fail-slow detector's view of a run: per fed iteration its measured time and the
    healthy time its workload model predicted (None during warm-up)."""

    iterations: list[int]
    measured_s: list[float]
    predicted_s: list[float | None]
    note: str = ""
    """How the series was obtained, or why it is empty."""


@dataclass(slots=True)
class RunData:
    """One run directory's files. `metrics`/`events` are split by run name."""

    run_dir: Path
    summary: dict[str, Any]
    config: dict[str, Any]
    metrics: dict[str, list[dict[str, Any]]]
    events: dict[str, list[dict[str, Any]]]
    timings: dict[str, list[dict[str, Any]]]
    detector: DetectorSeries | None = None
    names: list[str] = field(default_factory=list)
    """Run names in display order: the reference first, then the run with failures."""

    @property
    def main(self) -> str:
        """The run with failures ("faulty"; "train" for a run without a reference)."""
        return self.names[-1]


def _split(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        out.setdefault(r.get("run", "train"), []).append(r)
    return out


def read_run(run_dir: str | Path) -> RunData:
    """Read a run directory (`summary.json`, `config.json`, `events.jsonl`, `metrics.jsonl`,
    `timings.jsonl` when present).

    Raises:
        FileNotFoundError: the directory has no `summary.json` or `metrics.jsonl`.
    """
    run_dir = Path(run_dir)
    for name in ("summary.json", "metrics.jsonl"):
        if not (run_dir / name).is_file():
            raise FileNotFoundError(f"{run_dir} has no {name}; is it a run directory?")
    summary = json.loads((run_dir / "summary.json").read_text())
    config_path = run_dir / "config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    metrics = _split(read_jsonl(run_dir / "metrics.jsonl"))
    events_path, timings_path = run_dir / "events.jsonl", run_dir / "timings.jsonl"
    events = _split(read_jsonl(events_path)) if events_path.is_file() else {}
    timings = _split(read_jsonl(timings_path)) if timings_path.is_file() else {}
    names = [n for n in ("reference", "faulty", "train") if n in metrics]
    names += sorted(set(metrics) - set(names))
    return RunData(run_dir, summary, config, metrics, events, timings, names=names)


@dataclass(frozen=True, slots=True)
class Marker:
    """An event drawn on a timeline: at `t` seconds since the run's first iteration, or at
    iteration `iteration`."""

    kind: str
    """failure, recovered, slow, fail_slow or replan."""
    t: float
    iteration: int | None
    label: str


def markers(run: list[dict[str, Any]], events: list[dict[str, Any]]) -> list[Marker]:
    """The events worth marking on a run's timelines, in time order."""
    if not run:
        return []
    t0 = min(m["t_start"] for m in run)
    out = []
    for e in events:
        kind, t = e["kind"], e["t"] - t0
        if kind == "failure_injected" and e.get("fault") == "slow":
            factor = e.get("spec", "").partition("factor=")[2].split(",")[0]
            label = f"slow r{e.get('rank')}" + (f" ×{factor}" if factor else "")
            out.append(Marker("slow", t, e.get("iter"), label))
        elif kind == "failure_injected":
            label = f"{e.get('fault', 'failure')} r{e.get('rank')}"
            out.append(Marker("failure", t, e.get("iter"), label))
        elif kind == "recovery_done":
            label = f"recovered r{e.get('rank')}"
            out.append(Marker("recovered", t, e.get("resumed_iter"), label))
        elif kind == "fail_slow":
            who = f"r{e['rank']}" if e.get("rank") is not None else "sync"
            out.append(Marker("fail_slow", t, e.get("detected_at"), f"fail-slow {who} found"))
        elif kind in REPLAN_KINDS:
            out.append(Marker("replan", t, e.get("iteration", e.get("iter")), "re-plan"))
    return sorted(out, key=lambda m: m.t)


@dataclass(frozen=True, slots=True)
class RecoveryBar:
    """One recovery: its label and seconds per `SEGMENTS` entry (they add up to `total_s`)."""

    label: str
    mode: str
    seconds: dict[str, float]
    total_s: float


def _repairs(events: list[dict[str, Any]], t_fault: float) -> list[dict[str, Any]]:
    """`inplace_repair` events of the recovery of a failure at t_fault: those of the trainer
    generation that next reported ready (its ranks log their repairs around that moment, the
    slowest after it)."""
    ready = next((e for e in events if e["kind"] == "trainer_ready" and e["t"] > t_fault), None)
    if ready is None:
        return []
    return [
        e
        for e in events
        if e["kind"] == "inplace_repair"
        and e["t"] > t_fault
        and e.get("generation") == ready.get("generation")
    ]


def recovery_bars(summary: dict[str, Any], events: list[dict[str, Any]]) -> list[RecoveryBar]:
    """Per recovery of the summary, its time split into `SEGMENTS`.

    detect, recompute and total come from the summary; localize (with remap) and reconstruct
    from the summary if it carries them (`localize_s`, `reconstruct_s`), else from the repair
    events; init is the rest of the total (never negative).
    """
    injected = [e for e in events if e["kind"] == "failure_injected" and e.get("fault") != "slow"]
    used: set[int] = set()
    bars = []
    for r in summary.get("recoveries", []):
        idx = next(
            (
                i
                for i, e in enumerate(injected)
                if i not in used
                and e.get("rank") == r.get("rank")
                and e.get("iter") == r.get("iteration")
                and e.get("phase") == r.get("phase")
            ),
            None,
        )
        repairs = []
        if idx is not None:
            used.add(idx)
            repairs = _repairs(events, injected[idx]["t"])
        localize = r.get("localize_s")
        if localize is None:
            localize = max(
                ((e.get("localize_ms", 0) + e.get("remap_ms", 0)) / 1e3 for e in repairs),
                default=0.0,
            )
        reconstruct = r.get("reconstruct_s")
        if reconstruct is None:
            reconstruct = max((e.get("reconstruct_ms", 0) / 1e3 for e in repairs), default=0.0)
        detect = r.get("detect_s") or 0.0
        if detect != detect:  # NaN: the failure was never seen as detected
            detect = 0.0
        total = r.get("total_s", 0.0)
        recompute = r.get("recompute_s", 0.0)
        seconds = {
            "detect": detect,
            "localize": localize,
            "reconstruct": reconstruct,
            "recompute": recompute,
        }
        seconds["init"] = max(0.0, total - sum(seconds.values()))
        what = r.get("fault") or r.get("kind", "failure")
        label = f"{what} r{r.get('rank')} it {r.get('iteration')} {r.get('phase', '')}".strip()
        bars.append(
            RecoveryBar(
                label=label,
                mode=r.get("mode", ""),
                seconds={s: seconds[s] for s in SEGMENTS},
                total_s=total,
            )
        )
    return bars
