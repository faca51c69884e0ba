"""The run monitor analyzes a pending failure over a window of the run, not its whole history
(an hour-long soak made the whole-history analysis stall the coordinator): the breakdown of
every failure of recorded real runs is the same either way."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from unbroken.launch.coordinator.monitor import ANALYSIS_WINDOW_S
from unbroken.metrics.analysis import analyze_run, healthy_iter_s
from unbroken.metrics.log import read_jsonl

FIXTURES = Path(__file__).parent.parent / "sim" / "fixtures"
# real-run-d's events predate the `level` field of `shadows_promoted`: not analyzable at all.
RUNS = [FIXTURES / f"real-run-{x}" for x in "abcef"]


@pytest.mark.parametrize("run", RUNS, ids=[p.name for p in RUNS])
def test_the_windowed_breakdown_equals_the_whole_runs(run):
    rows = [m for m in read_jsonl(run / "metrics.jsonl") if m.get("run") != "reference"]
    events = [e for e in read_jsonl(run / "events.jsonl") if e.get("run") != "reference"]
    healthy = healthy_iter_s(rows)
    whole = analyze_run(rows, events, healthy_s=healthy)
    assert whole, "the fixture has recoveries"
    for r in whole:
        since = r.detected_t - ANALYSIS_WINDOW_S
        window = analyze_run(
            [m for m in rows if m["t_end"] >= since],
            [e for e in events if e.get("t", 0.0) >= since],
            healthy_s=healthy,
        )
        assert r in window, (r, window)


class _Emitted:
    def __init__(self) -> None:
        self.records: list[tuple[str, dict]] = []

    def emit(self, kind: str, **fields) -> None:
        self.records.append((kind, fields))


def _replay(mon, rows, events, tmp_path) -> None:
    """Feed a recorded run to the monitor as it grew: each row and event appended to its log
    in time order, a detection passed on as the coordinator passes it, a poll after each."""
    timeline = sorted(
        [(m["t_end"], "metrics.jsonl", m) for m in rows]
        + [(e.get("t", 0.0), "events.jsonl", e) for e in events],
        key=lambda x: x[0],
    )
    for t, file, rec in timeline:
        with open(tmp_path / file, "a") as fh:
            fh.write(json.dumps(rec) + "\n")
        if file == "events.jsonl" and rec["kind"] in ("failure_detected", "node_lost"):
            mon.failure_detected(rec.get("t_detected", t))
        mon.poll()


@pytest.mark.parametrize("run", RUNS, ids=[p.name for p in RUNS])
def test_the_monitor_replaying_a_run_reports_the_whole_runs_breakdown(run, tmp_path):
    """The live monitor (incremental window, median kept sorted, one analysis per poll) fed a
    recorded run as it grew reports every recovery the whole-run analysis finds, with the same
    detection and restart (its recompute is priced at the healthy iteration time of the rows
    seen so far, as it always was live, not of the whole run)."""
    from unbroken.launch.coordinator.monitor import RunMonitor

    rows = [m for m in read_jsonl(run / "metrics.jsonl") if m.get("run") != "reference"]
    events = [e for e in read_jsonl(run / "events.jsonl") if e.get("run") != "reference"]
    name = rows[0]["run"]
    whole = analyze_run(rows, events, healthy_s=healthy_iter_s(rows))
    log = _Emitted()
    mon = RunMonitor(tmp_path, name, 4, len(rows), log, quiet=True)
    _replay(mon, rows, events, tmp_path)
    mon.finish()
    done = [f for k, f in log.records if k == "recovery_done"]
    fields = ("mode", "rank", "detect_s", "restored_iter", "resumed_iter")
    assert [tuple(d[k] for k in fields) for d in done] == [
        (r.mode, r.rank, r.detect_s, r.restored_iter, r.iteration) for r in whole
    ]


QUICK_RETURN = Path(__file__).parent / "fixtures" / "soak-quick-return"


def test_a_recovery_whose_iteration_left_no_row_is_still_found():
    """A lost node back at once: the iteration it was lost in was finished by the survivors'
    generation, stopped for the larger world before rank 0 logged it; training resumed past it
    in place. The analysis counts it recovered (it once said "not recovered", and the live
    monitor then held every later report back behind it)."""
    rows = list(read_jsonl(QUICK_RETURN / "metrics.jsonl"))
    events = list(read_jsonl(QUICK_RETURN / "events.jsonl"))
    assert 779 not in {m["iter"] for m in rows}, "the fixture's hole"
    found = analyze_run(rows, events, healthy_s=healthy_iter_s(rows))
    (lost,) = [r for r in found if r.fault == "nodeloss"]
    assert (lost.iteration, lost.restored_iter, lost.recompute_s) == (779, 779, 0.0)
    assert lost.init_s < 1.0  # the survivors trained again within the second
    detected = [e for e in events if e["kind"] in ("failure_detected", "node_lost")]
    assert len(found) == len(detected)


def test_the_monitor_drops_a_pending_failure_it_cannot_analyze_once_a_later_one_recovers(
    tmp_path,
):
    """A pending failure the analysis never finds (here: a detection with no run behind it)
    does not hold back the later failures' reports; it is logged `recovery_unanalyzed`."""
    from unbroken.launch.coordinator.monitor import RunMonitor

    rows = list(read_jsonl(QUICK_RETURN / "metrics.jsonl"))
    events = list(read_jsonl(QUICK_RETURN / "events.jsonl"))
    log = _Emitted()
    mon = RunMonitor(tmp_path, rows[0]["run"], 4, 2000, log, quiet=True)
    phantom = rows[0]["t_end"] + 0.01
    mon.failure_detected(phantom)  # nothing in the logs belongs to it
    _replay(mon, rows, events, tmp_path)
    mon.finish()
    kinds = [k for k, _ in log.records]
    assert kinds.count("recovery_unanalyzed") == 1
    (unanalyzed,) = [f for k, f in log.records if k == "recovery_unanalyzed"]
    assert unanalyzed["detected_t"] == phantom
    detected = [e for e in events if e["kind"] in ("failure_detected", "node_lost")]
    assert kinds.count("recovery_done") == len(detected)
    assert not mon._pending
