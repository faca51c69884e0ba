"""`unbroken report RUN_DIR`: write the run's self-contained HTML report (`report.html`).

The page itself is `unbroken.metrics.report_html`. This command reads the run directory and
adds the one thing the files do not hold: the fail-slow detector's predicted healthy time of
every iteration. It replays the detector offline — the coordinator's own watch
(`unbroken.launch.slowwatch.SlowWatch`, same default thresholds, the same plan for a
hybrid-parallel job) fed the run's `metrics.jsonl` and `timings.jsonl` in order — and records
what the workload model predicted for each iteration before seeing it. The detector is a pure
function of that sequence, so the replay reaches the live run's verdicts; the report says
whether its fail-slow reports match the logged ones.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from unbroken.errors import UserError

__all__ = ["add_parser", "make_report", "replay_detector"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="write a run directory's self-contained HTML report")
    p.add_argument("run_dir", metavar="RUN_DIR", help="output dir of unbroken demo/train")
    p.add_argument("--out", help="HTML file to write (default: RUN_DIR/report.html)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    path = make_report(args.run_dir, args.out)
    print(f"report: {path}")
    return 0


class _Events:
    """Collects what the replayed watch would have logged."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def emit(self, kind: str, **fields: Any) -> None:
        self.rows.append({"kind": kind, **fields})


def _plan(config: dict[str, Any]):
    """The plan a hybrid-parallel job ran (as the coordinator derives it), or None."""
    par = config.get("parallel", {})
    if par.get("tp", 1) == 1 and par.get("pp", 1) == 1:
        return None
    from unbroken.config import DataConfig, JobConfig, ModelConfig, ParallelConfig
    from unbroken.config.loader import config_from_dict
    from unbroken.engine.build import plan_from_config

    data = config.get("data", {})
    job = JobConfig(
        model=config_from_dict(ModelConfig, config.get("model", {}), "config.json"),
        parallel=config_from_dict(ParallelConfig, par, "config.json"),
        # Only the micro-batch count shapes the plan; the tokenizer is not consulted.
        data=DataConfig(microbatches=data.get("microbatches", 4), tokenizer="bytes"),
    )
    return plan_from_config(job)


def _replay_note(live_events: list[dict], replayed_events: list[dict], fed: int) -> str:
    """What the replay fed and found, and whether its fail-slow reports match the live run's."""
    live = sorted(
        (e.get("rank"), e.get("since_iter")) for e in live_events if e["kind"] == "fail_slow"
    )
    replayed = sorted(
        (e.get("rank"), e.get("since_iter")) for e in replayed_events if e["kind"] == "fail_slow"
    )
    agree = (
        "the same fail-slow reports as" if live == replayed else "DIFFERENT fail-slow reports from"
    )
    return (
        f"Replayed offline from metrics.jsonl and timings.jsonl through the coordinator's "
        f"fail-slow watch: {fed} iterations fed (the first ones of each trainer "
        f"generation are skipped as the live watch does), {len(replayed)} fail-slow report(s), "
        f"{agree} the live run. Predicted: the workload model's healthy time for the "
        "iteration's documents (T_MB = αN + βΣl² per micro-batch, then the schedule), as the "
        "detector held it before seeing the iteration."
    )


def replay_detector(run) -> Any:
    """The detector's measured and predicted time per iteration of the run with failures.

    Args:
        run: a `unbroken.metrics.report_data.RunData`.

    Returns:
        A `DetectorSeries` (empty, with the reason in `note`, when the run has no timings).
    """
    from unbroken.detect import FailSlowDetector
    from unbroken.launch.slowwatch import SlowWatch
    from unbroken.metrics.report_data import DetectorSeries

    name = run.main
    timings, metrics = run.timings.get(name, []), run.metrics.get(name, [])
    if not timings:
        return DetectorSeries([], [], [], note="No timings.jsonl in this run: nothing to replay.")
    recorded: list[tuple[int, float, float | None]] = []

    class Recording(FailSlowDetector):
        def observe(self, obs):  # the prediction the detector holds before it sees obs
            p = self.predictor.iteration_time(obs.doc_lengths) if self.predictor else None
            recorded.append((obs.iteration, obs.seconds, p))
            return super().observe(obs)

    try:
        plan = _plan(run.config)
    except (UserError, ValueError) as exc:
        return DetectorSeries([], [], [], note=f"The plan could not be rebuilt: {exc}")
    world = run.config.get("parallel", {}).get("world_size") or len({t["rank"] for t in timings})
    events = _Events()
    watch = SlowWatch(world, events, lambda _line: None, plan=plan)
    watch.detector = Recording(None, plan=plan)
    by_attempt: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for t in timings:
        by_attempt.setdefault((t["iter"], t.get("generation", 0)), []).append(t)
    for m in metrics:
        for t in by_attempt.get((m["iter"], m.get("generation", 0)), []):
            watch.add_timing(t)
        watch.add_metric(m)
        watch.pump()
    if watch.disabled:
        return DetectorSeries([], [], [], note=f"The detector was off: {watch.disabled}")
    note = _replay_note(run.events.get(name, []), events.rows, len(recorded))
    its, measured, predicted = zip(*recorded, strict=True) if recorded else ((), (), ())
    return DetectorSeries(list(its), list(measured), list(predicted), note=note)


def make_report(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Read `run_dir`, replay its detector and write its report; returns the file written.

    Raises:
        UserError: `run_dir` is not a run directory.
    """
    from unbroken.metrics.report_data import read_run
    from unbroken.metrics.report_html import write_report

    try:
        run = read_run(run_dir)
    except FileNotFoundError as exc:
        raise UserError(str(exc)) from None
    if not run.names:
        raise UserError(f"{run_dir}: metrics.jsonl holds no iterations")
    run.detector = replay_detector(run)
    return write_report(run, out)
