"""The HTML report in a real browser: Debian's Chromium, headless, driven by Playwright.

Opens the report of a real run (the recorded `demo --quick --pp 2` run dir), with every network
request refused and recorded, and checks what a reader sees: both loss curves, the failures'
labels (no two overlapping), each failure's stacked recovery bars, the detector's series and
the audit. Saves a screenshot. Chromium comes from Debian (`apt-get install chromium`), never
from `playwright install`; without it this test fails, naming the fix.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from unbroken.metrics.report_data import SEGMENTS

CHROMIUM = Path("/usr/bin/chromium")
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
FIXTURE = Path(__file__).parents[1] / "sim" / "fixtures" / "timings" / "pp2-1f1b"


@pytest.fixture
def browser_page(tmp_path):
    if not CHROMIUM.exists():
        pytest.fail(
            f"{CHROMIUM} is missing: the browser test needs Debian's Chromium "
            "(apt-get install -y chromium; ./dev installs it for the test tier)"
        )
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("playwright is missing: pip install -e '.[test]'")
    with sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            str(tmp_path / "profile"),  # a new, empty user data dir
            executable_path=str(CHROMIUM),
            args=FLAGS,
            headless=True,
            viewport={"width": 1400, "height": 1000},
        )
        try:
            yield context.new_page()
        finally:
            context.close()


def _boxes(page, selector: str) -> list[dict]:
    return page.eval_on_selector_all(
        selector,
        "els => els.map(e => { const r = e.getBoundingClientRect();"
        " return {id: e.id, x: r.x, y: r.y, w: r.width, h: r.height}; })",
    )


def _overlap(a: dict, b: dict) -> bool:
    return (
        a["x"] < b["x"] + b["w"]
        and b["x"] < a["x"] + a["w"]
        and a["y"] < b["y"] + b["h"]
        and b["y"] < a["y"] + a["h"]
    )


def test_the_report_shows_failures_recoveries_and_both_loss_curves(browser_page, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(FIXTURE, run_dir)
    r = subprocess.run(
        [sys.executable, "-m", "unbroken", "report", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    page = browser_page
    requests: list[str] = []

    def refuse(route):
        requests.append(route.request.url)
        route.abort()

    page.route("http*://**", refuse)
    page.goto((run_dir / "report.html").as_uri())
    page.wait_for_load_state("load")
    assert requests == []  # nothing fetched: the page is self-contained

    # Both runs' loss per iteration, drawn and on screen.
    for run in ("reference", "faulty"):
        assert page.locator(f"#loss-iter-{run} path").first.is_visible()
        widest = max(_boxes(page, f"#loss-iter-{run} path"), key=lambda b: b["w"])
        assert widest["w"] > 200 and widest["h"] > 50
    # The failures, labelled on both timelines, with no two labels overlapping.
    titles = page.eval_on_selector_all(
        "[id^=label-iter-] > title", "els => els.map(e => e.textContent)"
    )
    assert {"kill r1 @8", "pageloss r2 @15", "exception r0 @20", "slow r3 ×3 @24"} <= set(titles)
    for chart in ("iter", "time", "detector"):
        boxes = _boxes(page, f"[id^=label-{chart}-]")
        assert boxes and all(b["w"] > 0 for b in boxes)
        for i, a in enumerate(boxes):
            for b in boxes[:i]:
                assert not _overlap(a, b), (a, b)
    # Each recovery's stacked bars: visible detect and init, segments end to end in one row.
    for i in range(3):
        segs = [_boxes(page, f"#bar-{i}-{s} path")[0] for s in SEGMENTS]
        assert segs[0]["w"] > 1 and segs[1]["w"] > 10
        ends = [s["x"] + s["w"] for s in segs]
        assert ends == sorted(ends)
        assert len({round(s["y"]) for s in segs if s["w"] > 0.5}) == 1
        assert page.locator(f"#recovery-{i}").is_visible()
    assert page.locator("#bar-2-recompute path").bounding_box()["width"] > 10
    # The detector's two series and the audit's verdict.
    # (This run's workload is uniform, so its predicted line is flat: zero height, full width.)
    for series in ("measured", "predicted"):
        (line,) = _boxes(page, f"#detector-{series} path[clip-path]")
        assert line["w"] > 100, series
    assert page.locator("#audit-verdict").inner_text().startswith("34 iterations compared, 0 ")
    assert page.locator("#audit-8").inner_text().count("no row") == 1
    shot = tmp_path / "report.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 50_000
