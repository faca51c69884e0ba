"""The live metrics endpoint and status page during a real job with a failure.

One job (2 ranks on gloo, a kill inside rank 1's update) started through the Python API with
Python objects — a model factory as `functools.partial`, a dataset *instance*, AdamW settings —
and `metrics_port=0`. An observer of our own holds the coordinator's loop at two points so the
test sees fixed states without depending on timing: after iteration 1 and once the failure is
recovered (the node timeout is raised above the hold, so the held loop is not taken for a
lost node). At each, the test scrapes `/metrics` (parsed with prometheus-client's own parser)
and reads the status page in Debian's headless Chromium (Playwright), which must show the
failure and its recovery; a screenshot is saved.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import threading
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from unbroken.config import DataConfig
from unbroken.metrics import RunObserver

from ..foundation.conftest import tiny_job
from ._objects import CountingDataset, build
from .conftest import chromium_page

HOLD_S = 300.0
"""Longest an observer holds the coordinator (the test releases it long before)."""


class Gate(RunObserver):
    """Holds the coordinator's loop after iteration 1 and after the first recovery until the
    test lets it go."""

    def __init__(self) -> None:
        self.reached = {"iter": threading.Event(), "recovered": threading.Event()}
        self.go = {"iter": threading.Event(), "recovered": threading.Event()}

    def _hold(self, point: str) -> None:
        if not self.reached[point].is_set():
            self.reached[point].set()
            self.go[point].wait(HOLD_S)

    def iteration(self, row: dict[str, Any]) -> None:
        if row["iter"] == 1:
            self._hold("iter")

    def recovered(self, breakdown: Any) -> None:
        self._hold("recovered")

    def release(self) -> None:
        for e in self.go.values():
            e.set()


def _samples(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = urllib.request.urlopen(url + "metrics", timeout=30).read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _wait(event: threading.Event, job: threading.Thread, what: str, result: dict) -> None:
    while not event.wait(1.0):
        assert job.is_alive(), f"the job ended before {what}: {result}"


@pytest.mark.timeout(600)
def test_metrics_and_status_page_during_a_run_with_a_kill(tmp_path):
    cfg = tiny_job(iterations=8, inject=["kill:rank=1,iter=4,phase=update"])
    # The gate holds the coordinator's loop, which then reads no node beats: a node timeout
    # longer than any hold keeps that silence from counting as a lost node.
    cfg = dataclasses.replace(
        cfg,
        data=DataConfig(tokens_per_microbatch=16, microbatches=2),
        recovery=dataclasses.replace(cfg.recovery, node_timeout_s=HOLD_S + 60),
    )
    gate = Gate()
    result: dict[str, Any] = {}

    def job() -> None:
        try:
            result["summary"] = __import__("unbroken").run_job(
                cfg,
                tmp_path / "run",
                model_factory=functools.partial(build, hidden=24),
                dataset=CountingDataset(seed=7, rows=16, microbatches=2),
                optimizer={"name": "adamw", "lr": 3e-3, "betas": (0.9, 0.95)},
                metrics_port=0,
                observers=[gate],
                quiet=True,
            )
        except BaseException as exc:  # reported by the test thread
            result["error"] = exc

    thread = threading.Thread(target=job, daemon=True)
    thread.start()
    try:
        _wait(gate.reached["iter"], thread, "iteration 1", result)
        url = json.loads((tmp_path / "run" / "live.json").read_text())["url"]
        assert url.startswith("http://127.0.0.1:")
        first = _samples(url)
        run = (("run", "train"),)
        assert first[("unbroken_iterations_total", run)] >= 2
        assert first[("unbroken_iterations_target", run)] == 8
        assert first[("unbroken_replans_total", run)] == 0
        with chromium_page(tmp_path) as page:
            page.goto(url)
            page.wait_for_function(
                "Number(document.querySelector('#chart').dataset.points) >= 2", timeout=60_000
            )
            points_early = int(page.locator("#chart").get_attribute("data-points"))
            assert page.locator("#state").inner_text().lower() == "running"
            gate.go["iter"].set()

            _wait(gate.reached["recovered"], thread, "the recovery", result)
            later = _samples(url)
            assert (
                later[("unbroken_iterations_total", run)]
                > first[("unbroken_iterations_total", run)]
            )
            labels = (("fault", "kill"), ("fault_class", "hof"), ("mode", "inplace"), *run)
            assert later[("unbroken_recoveries_total", tuple(sorted(labels)))] == 1
            hist = (("fault_class", "hof"), ("mode", "inplace"), *run)
            assert later[("unbroken_recovery_seconds_count", tuple(sorted(hist)))] == 1
            assert later[("unbroken_recovery_seconds_sum", tuple(sorted(hist)))] > 0
            failed = tuple(sorted((("cause", "exit"), ("fault", "kill"), *run)))
            assert later[("unbroken_failures_detected_total", failed)] == 1
            assert later[("unbroken_faults_injected_total", (("fault", "kill"), *run))] == 1

            # The page shows the failure and its recovery (it polls once a second).
            page.wait_for_function(
                "document.querySelector('#nrecovered').textContent === '1'", timeout=60_000
            )
            failure = page.locator("#events li.fault", has_text="failure detected: rank 1")
            assert failure.count() == 1
            assert "exited with status -9" in failure.inner_text()
            row = page.locator("#recovery-0").inner_text()
            assert "kill rank 1 it 4 update" in row and "inplace" in row
            assert page.locator("#ranks tbody tr").count() == 2
            assert int(page.locator("#chart").get_attribute("data-failures")) == 1
            assert int(page.locator("#chart").get_attribute("data-points")) > points_early
            shot = tmp_path / "status.png"
            page.screenshot(path=str(shot), full_page=True)
            assert shot.stat().st_size > 20_000
        gate.release()
        thread.join(HOLD_S)
    finally:
        gate.release()
    assert "error" not in result, result.get("error")
    s = result["summary"]
    assert s.state == "done" and s.failures_recovered == s.failures_detected == 1
    assert s.recoveries[0].mode == "inplace" and s.recoveries[0].fault == "kill"
    assert s["state"] == "done"  # the summary dict's keys still read
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["model"]["factory"] == "tests.metrics._objects:build"
    assert config["model"]["factory_args"] == {"hidden": 24}
    assert config["data"]["dataset"].startswith("unbroken_dataset_")
    assert config["train"]["lr"] == 3e-3 and config["train"]["beta2"] == 0.95
    assert Path(tmp_path / "run" / "summary.json").exists()
