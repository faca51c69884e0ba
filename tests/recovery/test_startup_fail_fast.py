"""A deterministic start-up failure fails fast: when every rank of a generation fails before its
first iteration with the same error, the job stops at once — no crash loop of restarts, no
reference retried — and the CLI prints the error and where its traceback is, exit 1."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from unbroken.launch.coordinator.core import startup_error
from unbroken.messages import RankExited, Shutdown, StopGeneration
from unbroken.metrics.log import read_jsonl
from unbroken.recovery import RecoveryState

from .test_detect_events import Job, job  # noqa: F401 -- the fixture

FACTORY = """
import torch


def build(hidden: int = 8):
    raise RuntimeError(f"cannot build a model of width {hidden} here")
"""


def _job_files(tmp_path: Path) -> Path:
    (tmp_path / "broken_model.py").write_text(FACTORY)
    config = tmp_path / "job.toml"
    config.write_text(
        """
[model]
factory = "broken_model:build"
[data]
tokens_per_microbatch = 64
microbatches = 2
max_documents = 100
[train]
iterations = 4
[parallel]
world_size = 2
"""
    )
    return config


def test_the_same_error_on_every_rank_stops_the_job_with_one_line(tmp_path):
    config = _job_files(tmp_path)
    out = tmp_path / "out"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "unbroken",
            "train",
            "--config",
            str(config),
            "--out",
            str(out),
            "--reference",
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 1, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr
    (line,) = lines
    assert line.startswith("unbroken: job failed: the fault-free reference run failed: every rank")
    assert "in attach: RuntimeError: cannot build a model of width 8 here" in line
    # The first rank to fail names its log (either rank may be first).
    logs = [out / "logs" / "reference" / f"gen0-rank{r}.log" for r in (0, 1)]
    (log,) = [p for p in logs if f"(traceback: {p})" in line]
    assert "Traceback (most recent call last):" in log.read_text()
    events = [e for e in read_jsonl(out / "events.jsonl") if e["run"] == "reference"]
    starts = [e for e in events if e["kind"] == "state" and e["new"] == "restarting"]
    assert starts == []  # no restart was tried
    assert [e["new"] for e in events if e["kind"] == "state"][-1] == "failed"


def test_startup_error_drops_only_the_rank():
    said = "unbroken-trainer[rank 3] in attach: error: n_kv_heads=2 is not divisible by 4"
    assert startup_error(said) == "in attach: error: n_kv_heads=2 is not divisible by 4"
    assert startup_error("something else") == "something else"


def test_different_start_up_errors_are_recovered_not_failed(job):  # noqa: F811
    def said(rank, what):
        return f"unbroken-trainer[rank {rank}] in restore: {what}"

    job.tell(RankExited(rank=0, generation=0, returncode=1, t=1.0, said=said(0, "OSError: a")))
    assert job.core.fsm.state is RecoveryState.RUNNING  # held: its peer may fail the same way
    job.tell(RankExited(rank=1, generation=0, returncode=1, t=1.1, said=said(1, "OSError: b")))
    assert job.core.fsm.state is RecoveryState.STOPPING
    assert job.heard() == StopGeneration(generation=0)
    (rec,) = job.records("failure_detected")
    assert rec["rank"] == 0  # the first to fail


def test_one_rank_failing_at_start_up_is_released_after_the_window(job):  # noqa: F811
    job.tell(RankExited(rank=1, generation=0, returncode=1, t=1.0, said="x"))
    job.core.tick(now=0.0)
    assert job.core.fsm.state is RecoveryState.RUNNING
    job.core.tick(now=float("inf"))
    assert job.core.fsm.state is RecoveryState.STOPPING


def test_the_same_start_up_error_on_every_rank_fails_at_once(job):  # noqa: F811
    for rank in (0, 1):
        msg = f"unbroken-trainer[rank {rank}] in attach: error: the plan does not fit"
        job.tell(RankExited(rank=rank, generation=0, returncode=1, t=1.0 + rank, said=msg))
    assert job.core.fsm.state is RecoveryState.FAILED
    assert job.heard() == Shutdown(generation=0)  # the generation it ended in
    assert "every rank failed before its first iteration: in attach: error: the plan" in (
        job.core.done_reason
    )


def test_a_checkpoint_fallback_on_every_rank_is_not_a_start_up_failure(job):  # noqa: F811
    """Every rank exits FALLBACK before its first iteration when retained state is beyond
    repair: the same recovery goes on from a checkpoint, not a new failure, not a job failure."""
    job.tell(RankExited(rank=0, generation=0, returncode=3, t=1.0, said="same"))
    assert job.core.fsm.state is RecoveryState.STOPPING
    assert job.heard() == StopGeneration(generation=0)
    job.tell(RankExited(rank=1, generation=0, returncode=3, t=1.1, said="same"))
    assert job.records("failure_detected") == []
    assert [e["rank"] for e in job.records("recovery_fallback")] == [0]
    assert job.core.fsm.fallback is True
