"""`unbroken report`: the page's parts from a real run directory, label lanes that never
overlap, recovery bars that add up to the summary's totals, and a page that needs nothing from
outside. (The page in a real browser: test_report_browser.py.)"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from unbroken.metrics import report_charts as charts
from unbroken.metrics.report_data import SEGMENTS, Marker, read_run, recovery_bars

FIXTURE = Path(__file__).parents[1] / "sim" / "fixtures" / "timings" / "pp2-1f1b"
"""A real `unbroken demo --quick --pp 2` run: 3 in-place recoveries, a fail-slow found."""


@pytest.fixture
def run_dir(tmp_path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(FIXTURE, dst)
    return dst


def test_lanes_separate_overlapping_spans_and_reuse_free_ones():
    spans = [(0, 50), (10, 60), (20, 30), (70, 90), (58, 65)]
    lanes = charts.assign_lanes(spans, gap=5)
    assert lanes == [0, 1, 2, 0, 0]  # (58, 65) fits after (0, 50); (70, 90) after it
    for i, a in enumerate(spans):
        for j, b in enumerate(spans[:i]):
            if lanes[i] == lanes[j]:
                assert a[0] >= b[1] + 5 or b[0] >= a[1] + 5


def _label_ids(svg: str) -> list[str]:
    return re.findall(r'<g id="(label-[^"]+)">', svg)


def test_labels_of_simultaneous_events_never_overlap():
    # Six events within half a second (kill r0 and slow r3 together, as in plot.png).
    marks = [Marker("failure", 10.0 + 0.1 * i, 5, f"kill r{i}") for i in range(4)] + [
        Marker("slow", 10.2, 5, "slow r3 ×3"),
        Marker("fail_slow", 10.3, 6, "fail-slow r3 found"),
    ]
    runs = {"reference": _rows(0.0), "faulty": _rows(0.0)}
    plt = charts._pyplot()
    fig, strip, (ax,) = charts._figure([2.0])
    ax.plot([0, 30], [1, 2])
    charts._label_strip(fig, strip, "t", [(m.t, m.label, charts.COLORS[m.kind]) for m in marks])
    renderer = fig.canvas.get_renderer()
    boxes = [t.get_window_extent(renderer) for t in strip.texts]
    assert len(boxes) == 6
    for i, a in enumerate(boxes):
        for b in boxes[:i]:
            assert not a.overlaps(b), (a, b)
    assert len({round(b.y0) for b in boxes}) >= 4  # they had to take lanes
    plt.close(fig)
    svg = charts.timeline_svg(runs, marks)
    assert len(_label_ids(svg)) == 6
    assert "<title>kill r0</title>" in svg


def _rows(t0: float) -> list[dict]:
    return [
        {"iter": i, "t_start": t0 + i, "t_end": t0 + i + 1, "loss": 5 - i / 10, "tokens_per_s": 1e3}
        for i in range(30)
    ]


def test_recovery_bars_split_the_summary_totals(run_dir):
    run = read_run(run_dir)
    bars = recovery_bars(run.summary, run.events["faulty"])
    # (This recording predates the summary's `fault` field: its failures are labelled "hof".)
    assert [b.label for b in bars] == [
        "hof r1 it 8 update",
        "hof r2 it 15 writeback",
        "hof r0 it 20 backward",
    ]
    for bar, rec in zip(bars, run.summary["recoveries"], strict=True):
        assert list(bar.seconds) == list(SEGMENTS)
        assert sum(bar.seconds.values()) == pytest.approx(rec["total_s"])
        assert bar.seconds["detect"] == rec["detect_s"]
        assert bar.seconds["recompute"] == rec["recompute_s"]
        assert all(v >= 0 for v in bar.seconds.values())
    # The repair of iteration 8's interrupted update was logged by every rank; the bar takes
    # the slowest rank's reconstruct time.
    repairs = [
        e["reconstruct_ms"] / 1e3
        for e in run.events["faulty"]
        if e["kind"] == "inplace_repair" and e["generation"] == 1
    ]
    assert bars[0].seconds["reconstruct"] == pytest.approx(max(repairs))
    assert bars[2].seconds["recompute"] > 0  # the exception in backward redid iteration 20


def test_a_summary_with_its_own_localize_and_reconstruct_wins():
    summary = {
        "recoveries": [
            {
                "rank": 0,
                "iteration": 3,
                "phase": "update",
                "fault": "kill",
                "mode": "inplace",
                "detect_s": 0.1,
                "init_s": 1.0,
                "recompute_s": 0.5,
                "total_s": 1.5,
                "localize_s": 0.2,
                "reconstruct_s": 0.3,
            }
        ]
    }
    (bar,) = recovery_bars(summary, [])
    assert bar.seconds == {
        "detect": 0.1,
        "init": pytest.approx(0.4),
        "localize": 0.2,
        "reconstruct": 0.3,
        "recompute": 0.5,
    }


def test_a_repair_logged_after_the_generation_reported_ready_still_counts():
    # Ranks log their repairs around the generation's trainer_ready; the slowest comes after.
    events = [
        {"t": 10.0, "kind": "failure_injected", "rank": 2, "iter": 5, "phase": "writeback"},
        {
            "t": 12.0,
            "kind": "inplace_repair",
            "generation": 1,
            "localize_ms": 1,
            "reconstruct_ms": 2,
        },
        {"t": 12.1, "kind": "trainer_ready", "generation": 1},
        {
            "t": 12.2,
            "kind": "inplace_repair",
            "generation": 1,
            "localize_ms": 3,
            "reconstruct_ms": 129,
        },
        {
            "t": 30.0,
            "kind": "inplace_repair",
            "generation": 2,
            "localize_ms": 9,
            "reconstruct_ms": 999,
        },
    ]
    rec = {"rank": 2, "iteration": 5, "phase": "writeback", "detect_s": 0.1, "total_s": 2.5}
    (bar,) = recovery_bars({"recoveries": [rec]}, events)
    assert bar.seconds["reconstruct"] == pytest.approx(0.129)
    assert bar.seconds["localize"] == pytest.approx(0.003)


def _unbroken(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "unbroken", *args], capture_output=True, text=True, timeout=300
    )


def test_report_of_a_real_run_holds_every_part_and_nothing_external(run_dir):
    r = _unbroken("report", str(run_dir))
    assert r.returncode == 0, r.stderr
    page = (run_dir / "report.html").read_text()
    assert f"report: {run_dir / 'report.html'}" in r.stdout
    # Comparison table, as `unbroken demo` prints it.
    summary = json.loads((run_dir / "summary.json").read_text())
    assert 'id="comparison"' in page and summary["final_state_hash"] in page
    # Both runs' loss per iteration, the timeline, the bars, the detector, the audit.
    for gid in (
        "loss-iter-reference",
        "loss-iter-faulty",
        "timeline-loss-faulty",
        "timeline-tps-reference",
        "detector-measured",
        "detector-predicted",
    ):
        assert f'<g id="{gid}">' in page, gid
    for i in range(3):
        for seg in SEGMENTS:
            assert f'<g id="bar-{i}-{seg}">' in page
    assert "<title>kill r1 @8</title>" in page and "<title>slow r3 ×3 @24</title>" in page
    assert "the same fail-slow reports as the live run" in page
    hashes = {json.loads(ln)["state_hash"] for ln in (run_dir / "metrics.jsonl").open()}
    assert all(h in page for h in hashes)
    assert 'id="audit-verdict">34 iterations compared, 0 mismatched' in page
    # Self-contained: no script, no link, no external reference of any kind.
    assert "<script" not in page and "<link" not in page
    refs = re.findall(r'(?:src|href|xlink:href)="([^"]*)"', page)
    assert refs and all(ref.startswith("#") for ref in refs)
    assert "url(http" not in page and "@import" not in page


def test_report_of_a_missing_run_is_one_line(tmp_path):
    r = _unbroken("report", str(tmp_path / "nope"))
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "has no summary.json" in lines[0] and "Traceback" not in r.stderr


@pytest.mark.parametrize(
    "name",
    sorted(
        str(p.parent.relative_to(FIXTURE.parents[1]))
        for p in FIXTURE.parents[1].glob("**/summary.json")
    ),
)
def test_every_recorded_run_dir_gets_a_report(tmp_path, name):
    from unbroken.cli.report import make_report

    src = FIXTURE.parents[1] / name
    shutil.copytree(src, tmp_path / "run")
    page = make_report(tmp_path / "run").read_text()
    summary = json.loads((src / "summary.json").read_text())
    assert f"failures recovered: {summary['failures_recovered']}/" in page
    assert page.count('<g id="loss-iter-') == len(
        {json.loads(ln).get("run") for ln in (src / "metrics.jsonl").open()}
    )
