"""Cluster configs: examples/cluster.toml loads, typos fail with key and file, CLI exits 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from unbroken.cli.main import main
from unbroken.errors import UserError
from unbroken.sim.presets import load_hardware, load_model, model_names
from unbroken.sim.scenario import evaluate, load_scenario
from unbroken.sim.trace import read_trace

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "cluster.toml"


def test_every_model_preset_matches_its_published_size():
    for name in model_names():
        model, par = load_model(name)
        assert model.dense_body_params > 0, name
        assert model.expert_params + model.dense_body_params + model.embedding_params == (
            pytest.approx(model.total_params)
        )
        assert par.world >= 4


def test_example_cluster_config_evaluates():
    rows, _ = evaluate(load_scenario(config=EXAMPLE))
    assert rows and all(0 < r["ettr"] < 1 for r in rows)


def test_unknown_key_names_key_and_file(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        '[[workload]]\nmodel = "deepseek-v3"\nhardware = "h100"\n[failures]\nmtf_s = 5\n'
    )
    with pytest.raises(UserError, match=r"c\.toml.*'mtf_s'"):
        load_scenario(config=cfg)
    cfg.write_text(
        '[[workload]]\nmodel = { preset = "deepseek-v3", layerz = 3 }\nhardware = "h100"\n'
    )
    with pytest.raises(UserError, match=r"c\.toml.*'layerz'"):
        load_scenario(config=cfg)
    with pytest.raises(UserError, match="unknown hardware preset"):
        load_hardware("tpu")
    with pytest.raises(UserError, match="must divide"):
        load_model("deepseek-v3", {"ep": 7})


def test_cli_user_error_is_one_line_exit_2(tmp_path, capsys):
    cfg = tmp_path / "bad.toml"
    cfg.write_text("[simulate]\npolicies = ['magic']\n")
    assert main(["simulate", "--config", str(cfg), "--no-png"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "bad.toml" in err[0] and "magic" in err[0]


def test_trace_file(tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text("# gcp spot segment\nt_s,kind\n600,HOF\n1200,FF\n1500,fail-slow\n")
    assert [f.kind for f in read_trace(trace)] == ["hof", "fatal", "fail-slow"]
    trace.write_text("t_s,kind\n600,meteor\n")
    with pytest.raises(UserError, match=r"t\.csv:2"):
        read_trace(trace)


def test_cli_replays_a_trace(tmp_path, capsys):
    trace = tmp_path / "t.csv"
    trace.write_text("t_s,kind\n" + "".join(f"{600 * i},{'hof' if i % 2 else 'fatal'}\n"
                                           for i in range(1, 9)))  # fmt: skip
    args = ["simulate", "--config", str(EXAMPLE), "--trace", str(trace), "--json", "--no-png"]
    assert main(args) == 0
    import json

    rows = json.loads(capsys.readouterr().out)["rows"]
    assert all("ettr_des" in r for r in rows)
    assert {r["hof_ratio"] for r in rows} == {0.5}


def test_measured_overrides_and_fixed_interval(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        '[[workload]]\nmodel = "kimi-moe"\nhardware = "a100-p4d"\nt_iter_s = 9.097\n'
        "t_ckpt_s = 8.34\n[failures]\nhof_ratio = [1.0]\n[recovery]\nckpt_interval = 11\n"
    )
    rows, _ = evaluate(load_scenario(config=cfg))
    by = {r["policy"]: r for r in rows}
    assert {r["t_iter_s"] for r in rows} == {9.097}
    assert {by[p]["ckpt_interval"] for p in ("inplace", "gemini+", "gemini")} == {11}
    # Eq. 7 with the measured inputs: T_eff = 9.097 + 8.34/11, L = 11/2 + 1.
    t_eff = 9.097 + 8.34 / 11
    assert by["gemini+"]["t_eff_s"] == pytest.approx(t_eff)
    rec = by["gemini+"]["t_rec_s"] - 6.5 * t_eff
    assert rec == pytest.approx(1.0 + 25.7 + 8.34)  # T_det + rank setup + remote load


def test_testbed_preset_and_interval_flag(capsys):
    args = ["simulate", "--preset", "leto-testbed", "--interval", "32", "--json", "--no-png"]
    assert main(args) == 0
    import json

    rows = json.loads(capsys.readouterr().out)["rows"]
    assert {r["ckpt_interval"] for r in rows} == {32}
    assert main(["simulate", "--preset", "leto-testbed", "--interval", "0", "--no-png"]) == 2
