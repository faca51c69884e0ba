"""Profile input (App. C.1 input (a)) and the remaining CLI paths."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from unbroken.cli.main import main
from unbroken.errors import UserError
from unbroken.sim.profile import load_profile

PROFILE = {
    "microbatches": 8,
    "vpp": 2,
    "stages": [
        {"brackets_s": [0.10, 0.11], "p2p_s": 0.002, "extra_s": 0.01},
        {"brackets_s": [0.12, 0.10], "p2p_s": 0.002, "extra_s": 0.05},
    ],
    "backward_window_s": 0.14,
    "grad_buckets": [{"params": 4.0e7, "seconds": 0.05}, {"params": 4.0e7, "seconds": 0.05}],
    "update_s": 0.06,
    "ckpt_s": 8.3,
    "ckpt_load_remote_s": 8.3,
    "ckpt_load_local_s": 0.5,
    "rmu_s": 0.05,
    "gpus": 64,
}


def test_profile_gives_the_pipeline_formula(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(PROFILE))
    inputs, steps = load_profile(path)
    stage = 0.12 + 0.10 + 0.002 + 0.05
    # (M + (S-1)/v) * max stage + E (queue: f = 0.07+0.05 -> 0.14+0.05 -> E = 0.05) + update
    assert steps.t_iter_s == pytest.approx((8 + 1 / 2) * stage + 0.05 + 0.06)
    assert inputs.stage_s[1] == pytest.approx(stage)
    assert steps.gpus == 64 and steps.t_ckpt_s == 8.3


def test_profile_errors_name_the_file_and_key(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({**PROFILE, "stages": [{"brackets": [0.1]}]}))
    with pytest.raises(UserError, match=r"p\.json: stages\[0\].*'brackets'"):
        load_profile(path)
    path.write_text("{not json")
    with pytest.raises(UserError, match="invalid JSON"):
        load_profile(path)


def test_config_with_a_profile_workload(tmp_path, capsys):
    (tmp_path / "p.json").write_text(json.dumps(PROFILE))
    cfg = tmp_path / "c.toml"
    cfg.write_text('[[workload]]\nlabel = "measured"\nprofile = "p.json"\n')
    assert main(["simulate", "--config", str(cfg), "--json", "--no-png"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert {r["model"] for r in rows} == {"measured"} and len(rows) == 9


def test_des_cli_reports_interval_and_progress(capsys):
    example = Path(__file__).resolve().parents[2] / "examples" / "cluster.toml"
    args = ["simulate", "--config", str(example), "--des", "--replications", "3",
            "--horizon-mttf", "200", "--mttf", "10m", "--hof", "0.5", "--policies",
            "inplace,gemini+", "--no-png"]  # fmt: skip
    assert main(args) == 0
    captured = capsys.readouterr()
    assert "95% CI" in captured.out
    assert "[simulate" in captured.err


def test_validate_json(capsys):
    run = Path(__file__).parent / "fixtures" / "real-run-b"
    assert main(["simulate", "--validate", str(run), "--json"]) == 0
    (v,) = json.loads(capsys.readouterr().out)["validations"]
    assert abs(v["error_points"]) <= 3.0 and len(v["failures"]) == 2


def test_bad_flags_are_user_errors(capsys):
    assert main(["simulate", "--preset", "leto-fig14", "--mttf", "soon", "--no-png"]) == 2
    assert main(["simulate", "--preset", "nope", "--no-png"]) == 2
    assert main(["simulate", "--validate", "/nonexistent"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(line.startswith("unbroken: error:") for line in err)


def test_profile_and_model_together_is_an_error(tmp_path):
    from unbroken.sim.scenario import load_scenario

    (tmp_path / "p.json").write_text(json.dumps(PROFILE))
    cfg = tmp_path / "c.toml"
    cfg.write_text('[[workload]]\nprofile = "p.json"\nmodel = "olmoe"\n')
    with pytest.raises(UserError, match="either profile or model"):
        load_scenario(config=cfg)
