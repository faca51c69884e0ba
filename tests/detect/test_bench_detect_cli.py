"""`unbroken bench detect` end to end on this machine: real jobs, then both detectors scored."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys

import pytest


def _bench(*args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "unbroken", "bench", "detect", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.slow  # 16 s: a benchmark's harness (CI keeps its argument errors and the detectors)
def test_two_jobs_run_and_score_with_the_issue_keys(tmp_path):
    out = tmp_path / "logs"
    run = _bench(
        "--jobs", "2", "--iterations", "26", "--tokens", "512", "--out", str(out), "--json"
    )
    assert run.returncode == 0, run.stderr
    doc = json.loads(run.stdout)
    assert doc["jobs"] == 2 and doc["faulty_jobs"] == 1
    keys = {"mb_mape", "iter_mape", "false_alarms_per_job", "accuracy", "detect_delay_iters"}
    for mode in ("ours", "baseline"):
        assert keys | {"overhead_pct"} <= doc[mode].keys()
        assert doc[mode]["mb_mape"] > 0.0  # measured times never match a model exactly
    assert doc["setup"]["model"].startswith("tiny, 1 layer(s), 1 head(s)")
    # Every rank of every job logged every iteration, with its micro-batch timings.
    for j in range(2):
        for r in range(2):
            lines = (out / f"job{j}-rank{r}.jsonl").read_text().splitlines()
            assert len(lines) == 26
            assert len(json.loads(lines[-1])["mb_s"]) == 3
    # Scoring the same logs again gives the same verdicts, and describes the recorded jobs
    # (their bench-spec.json), not this command's flags.
    again = _bench("--replay", str(out), "--tokens", "4096", "--json")
    assert again.returncode == 0, again.stderr
    replay = json.loads(again.stdout)
    assert replay["setup"]["tokens_per_microbatch"] == 512
    assert replay["setup"]["model"] == doc["setup"]["model"]
    for mode in ("ours", "baseline"):
        for key in ("accuracy", "false_alarms_per_job", "mb_mape"):
            assert replay[mode][key] == pytest.approx(doc[mode][key])


def _gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("--preset", "huge"), "--preset 'huge' is unknown"),
        (("--world-size", "1"), "world_size must be >= 2"),
        (("--jobs", "0"), "--jobs must be >= 1"),
        (("--device", "cuda", "--jobs", "1"), "2 ranks need 2 GPUs"),
        (("--workload", "phases", "--short-tokens", "0"), "short_tokens must be >= 1"),
    ],
)
def test_bad_arguments_are_one_line_errors(args, needle):
    if args[0] == "--device" and _gpus() >= 2:
        pytest.skip("this machine has the GPUs: the job would run")
    run = _bench(*args, timeout=60)
    assert run.returncode == 2 and needle in run.stderr
    assert "Traceback" not in run.stderr


def test_measured_loss_compares_the_same_workload_across_a_phase_change():
    from unbroken.bench.detect_evaluate import JobSeries
    from unbroken.bench.detect_report import _measured_loss

    from .synth import series

    # Mostly one document per micro-batch until the fault, then four (far cheaper attention)
    # while rank 1 computes 2x slower: raw medians would hide most of the loss.
    def pieces(it, rng):
        return 4 if it >= 30 else int(rng.choice([1, 1, 2]))

    obs = series(iterations=50, pieces=pieces, slow_rank=1, slow_iter=30, factor=2.0, seed=3)
    job = JobSeries(
        index=0,
        observations=obs,
        fault_rank=1,
        fault_iter=30,
        fault_spec="slow:rank=1,iter=30,level=medium",
    )
    ((key, (loss,)),) = _measured_loss([job]).items()
    assert key == ("compute", "medium")
    # Twice the compute, plus the same sync constant: a loss just under 1/2.
    assert 0.40 < loss < 0.5
    raw = 1 - statistics.median(o.seconds for o in obs[2:30]) / statistics.median(
        o.seconds for o in obs[31:]
    )
    assert raw < 0.2
