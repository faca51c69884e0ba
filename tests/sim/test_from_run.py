"""`unbroken simulate --profile-from`: a per-stage profile from a real run, fed back in.

Fixtures are real runs' records (no run happens here):

- `timings/pp2-1f1b`: `unbroken demo --quick --pp 2` (4 CPU ranks, dp 2 x pp 2, 1F1B), all
  of its run's small files;
- `timings/dp-reference`: `unbroken demo --quick` (4 data-parallel CPU ranks), the reference
  run's lines only.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from unbroken.cli.main import main
from unbroken.errors import UserError
from unbroken.sim.from_run import profile_from_run
from unbroken.sim.itertime import iteration_time
from unbroken.sim.profile import load_profile, profile_from_dict

FIXTURES = Path(__file__).parent / "fixtures"
PLAN_RUN = FIXTURES / "timings" / "pp2-1f1b"
DP_RUN = FIXTURES / "timings" / "dp-reference"
TOLERANCE = 0.10
"""Predicted T_iter within 10% of the measured iteration (this run: +5.1%)."""


def _close(predicted: float, measured: float) -> bool:
    return abs(predicted / measured - 1.0) <= TOLERANCE


def test_plan_run_profile_predicts_its_iteration(tmp_path):
    result = profile_from_run(PLAN_RUN)
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(result.profile))
    inputs, steps = load_profile(path)  # the simulator's own loader
    assert steps.t_iter_s == pytest.approx(result.predicted_iter_s)
    assert result.kind == "plan" and result.run == "reference" and not result.fitted
    assert (inputs.microbatches, len(inputs.stage_s), inputs.vpp) == (2, 2, 1)
    assert result.measured_iter_s is not None
    assert _close(steps.t_iter_s, result.measured_iter_s)
    # Every profile field the run gave a value for says where it came from.
    derived = result.profile["derived"]
    for key in ("microbatches", "stages[].brackets_s", "grad_buckets", "update_s", "ckpt_s"):
        assert key in derived
    assert steps.gpus == 4 and steps.replicated_optimizer and steps.t_ckpt_s > 0


def test_a_wrong_profile_misses_the_measurement():
    """The check discriminates: the same run's profile without its pipeline bubble (all layers
    on one stage), or with twice the micro-batches, falls outside the tolerance."""
    result = profile_from_run(PLAN_RUN)
    measured = result.measured_iter_s
    assert measured is not None
    prof = result.profile
    merged = {
        "brackets_s": [b for s in prof["stages"] for b in s["brackets_s"]],
        "p2p_s": 0.0,
        "extra_s": 0.0,
    }
    one_stage = {**prof, "stages": [merged]}
    doubled = {**prof, "microbatches": 2 * prof["microbatches"]}
    for wrong in (one_stage, doubled):
        _, steps = profile_from_dict(wrong, "wrong")
        assert not _close(steps.t_iter_s, measured)


def test_cli_writes_a_profile_the_config_path_reads(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["simulate", "--profile-from", str(PLAN_RUN), "--profile-out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "predicted T_iter" in text and "error" in text
    assert main(["simulate", "--profile-from", str(PLAN_RUN), "--profile-out", str(out),
                 "--json"]) == 0  # fmt: skip
    summary = json.loads(capsys.readouterr().out)
    assert abs(summary["error"]) <= TOLERANCE
    cfg = tmp_path / "c.toml"
    cfg.write_text('[[workload]]\nlabel = "pp2"\nprofile = "p.json"\n')
    assert main(["simulate", "--config", str(cfg), "--json", "--no-png"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert rows and all(r["t_iter_s"] == pytest.approx(summary["predicted_iter_s"]) for r in rows)


def test_data_parallel_run_fits_update_and_says_so():
    result = profile_from_run(DP_RUN)
    assert result.kind == "data-parallel" and result.fitted == ["update_s"]
    assert result.measured_iter_s is None
    assert result.profile["derived"]["update_s"].startswith("FITTED")
    assert result.predicted_iter_s == pytest.approx(result.measured_spacing_s)
    # The measured parts alone (update left out) stay below the measured iteration.
    inputs, _ = profile_from_dict(result.profile, "dp")
    assert iteration_time(dataclasses.replace(inputs, update_s=0.0)).iter_s < result.reference_s


def test_run_without_timings_is_a_user_error(tmp_path, capsys):
    with pytest.raises(UserError, match=r"timings\.jsonl"):
        profile_from_run(FIXTURES / "real-run-b")
    assert main(["simulate", "--profile-from", str(tmp_path / "nope")]) == 2
    assert main(["simulate", "--list", "--profile-out", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("unbroken: error:") for line in err)


def test_bucket_sizes_are_all_or_none(tmp_path):
    prof = profile_from_run(PLAN_RUN).profile
    two = [{"seconds": 0.01}, {"seconds": 0.01}]
    inputs, _ = profile_from_dict({**prof, "grad_buckets": two}, "equal")
    assert inputs.bucket_params == (1.0, 1.0)
    with pytest.raises(UserError, match="on every grad bucket, or on none"):
        profile_from_dict({**prof, "grad_buckets": [{"seconds": 0.01, "params": 5.0}, two[1]]}, "x")
