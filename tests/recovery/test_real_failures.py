"""Failures nobody injected — the only kind a user has: a trainer killed from outside the job
gets its recovery breakdown, and a trainer that crashes says why (its traceback in its log,
and on the terminal with --debug)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from unbroken.api import run_job
from unbroken.metrics.log import read_jsonl

from ..foundation.conftest import tiny_job

WAIT_S = 300


def _trainer_pid(spec: Path, rank: int) -> int | None:
    """The live trainer process started from `spec` for `rank` (from /proc)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        except (OSError, UnicodeDecodeError):
            continue
        if "unbroken.launch.trainer" not in args or str(spec) not in args:
            continue
        if args[args.index("--rank") + 1] == str(rank):
            return int(pid)
    return None


def _wait_for(condition, what: str):
    """Poll a condition on files the job writes (not a sync by sleep: the condition is)."""
    deadline = time.time() + WAIT_S
    while time.time() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_trainer_killed_from_outside_gets_its_recovery_breakdown(tmp_path):
    cfg = tiny_job(iterations=40)
    result: dict = {}
    job = threading.Thread(
        target=lambda: result.update(run_job(cfg, tmp_path, reference=True, quiet=True)),
        daemon=True,
    )
    job.start()

    def faulty_progress():
        rows = [m for m in read_jsonl(tmp_path / "metrics.jsonl") if m["run"] == "faulty"]
        return rows and rows[-1]["iter"] >= 3

    _wait_for(faulty_progress, "the faulty run's third iteration")
    pid = _wait_for(
        lambda: _trainer_pid(tmp_path / "specs" / "faulty-gen0.json", 1), "rank 1's trainer"
    )
    os.kill(pid, signal.SIGKILL)  # a plain kill -9: the injector knows nothing of it
    job.join(timeout=WAIT_S)
    assert not job.is_alive()
    s = result
    assert s["state"] == "done" and s["bit_exact"] is True
    assert s["failures_injected"] == 0
    (rec,) = s["recoveries"]
    assert (rec["rank"], rec["injected"], rec["fault"], rec["cause"]) == (1, False, "", "exit")
    assert rec["mode"] == "inplace" and rec["kind"] == "hof"
    assert rec["iteration"] >= 3 and rec["phase"]
    assert rec["init_s"] > 0 and rec["total_s"] >= rec["init_s"] + rec["recompute_s"] - 1e-9
    detected = [
        e
        for e in read_jsonl(tmp_path / "events.jsonl")
        if e["run"] == "faulty" and e["kind"] == "failure_detected"
    ]
    (det,) = detected
    assert det["returncode"] == -signal.SIGKILL and det["injected"] is None
    done = [e for e in read_jsonl(tmp_path / "events.jsonl") if e["kind"] == "recovery_done"]
    assert [(e["rank"], e["injected"]) for e in done] == [(1, False)]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["recoveries"] == s["recoveries"]


def _config_file(tmp_path: Path) -> Path:
    path = tmp_path / "job.toml"
    path.write_text(
        """
[model]
preset = "tiny"
[data]
tokens_per_microbatch = 64
microbatches = 2
max_documents = 200
[train]
iterations = 6
[parallel]
world_size = 2
[recovery]
mode = "ckpt_restart"
max_restarts = 0
heartbeat_interval_s = 0.1
heartbeat_timeout_s = 1.5
"""
    )
    return path


def test_a_crashing_trainer_writes_its_traceback_to_its_log_and_debug_shows_it(tmp_path):
    config = _config_file(tmp_path)
    fault = "exception:rank=1,iter=2,phase=backward"
    base = [sys.executable, "-m", "unbroken"]
    args = ["train", "--config", str(config), "--inject", fault, "--no-reference"]
    plain = subprocess.run(
        [*base, *args, "--out", str(tmp_path / "plain")],
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )
    log = (tmp_path / "plain" / "logs" / "train" / "gen0-rank1.log").read_text()
    assert "Traceback (most recent call last):" in log
    assert "InjectedFault: injected exception" in log
    last = log.strip().splitlines()[-1]
    assert last.startswith("unbroken-trainer[rank 1] in training: InjectedFault")
    assert "Traceback" not in plain.stderr  # the terminal stays one line per event
    assert plain.returncode != 0  # max_restarts = 0: the failure ends the job

    debug = subprocess.run(
        [*base, "--debug", *args, "--out", str(tmp_path / "debug")],
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )
    assert debug.returncode == plain.returncode != 0, debug.stderr[-2000:]
    assert "rank 1 traceback:" in debug.stderr
    assert "Traceback (most recent call last):" in debug.stderr
    assert "InjectedFault: injected exception" in debug.stderr
