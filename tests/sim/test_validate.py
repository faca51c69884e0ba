"""`--validate`: predicted vs measured ETTR of run dirs in the runtime's output format.

Fixture dirs: `run-*` are hand-made (tests/sim/fixtures/make_fixtures.py); `real-run-*` are the
logs of real `unbroken train` runs on the 4-rank CPU demo job (commands and results in
bench/results/sim-validate.md).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from unbroken.cli.main import main
from unbroken.errors import UserError
from unbroken.sim.validate import validate_run

FIXTURES = Path(__file__).parent / "fixtures"
RUNS = sorted(p for p in FIXTURES.iterdir() if p.is_dir() and (p / "metrics.jsonl").exists())


@pytest.mark.parametrize("run_dir", RUNS, ids=lambda p: p.name)
def test_prediction_within_3_points(run_dir):
    v = validate_run(run_dir)
    assert v.failures, "fixture must contain failures"
    assert abs(v.error_points) <= 3.0, v.as_dict()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert v.measured_ettr == pytest.approx(summary["ettr"], abs=1e-9)


def test_two_fixtures_with_different_schedules():
    modes = {tuple(f["mode"] for f in validate_run(r).failures) for r in RUNS}
    assert len(RUNS) >= 2 and len(modes) >= 2


def test_at_least_two_real_runs_with_different_failure_schedules():
    real = [r for r in RUNS if r.name.startswith("real-run-")]
    schedules = {
        tuple((f["iteration"], f["phase"]) for f in validate_run(r).failures) for r in real
    }
    # real-run-e and -f are two runs of `unbroken demo --quick`: one schedule, twice (noise).
    assert len(real) >= 2 and len(schedules) >= 2


def test_cli_validate_prints_predicted_and_measured(capsys):
    assert main(["simulate", "--validate", *map(str, RUNS)]) == 0
    out = capsys.readouterr().out
    assert "predicted" in out and "measured" in out


def test_missing_reference_is_a_user_error(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(RUNS[0], run)
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("\n".join(x for x in lines if '"reference"' not in x) + "\n")
    with pytest.raises(UserError, match="reference"):
        validate_run(run)
    with pytest.raises(UserError, match="not a directory"):
        validate_run(tmp_path / "nope")
