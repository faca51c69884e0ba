"""`unbroken bench plan --json` and `unbroken plan` from the command line."""

from __future__ import annotations

import json

import pytest

from unbroken.cli.main import main
from unbroken.parallel import ParallelPlan


def test_bench_plan_json_rows(capsys):
    rc = main(["bench", "plan", "--json", "--models", "llama2-7b", "--sections", "slow"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    rows = out["results"]
    for r in rows:
        assert {"scenario", "model", "policy", "samples_per_s", "survived", "plan_ms"} <= set(r)
    slow = [r for r in rows if r["scenario"] == "fail-slow/compute/severe"]
    assert {r["policy"] for r in slow} == {"none", "greyhound", "adaptra", "resihp"}
    none = next(r for r in slow if r["policy"] == "none")
    healthy = next(r for r in rows if r["policy"] == "initial plan")
    # the severity is the scenario's definition: the unmitigated job loses 70 %
    assert none["samples_per_s"] / healthy["samples_per_s"] == pytest.approx(0.3)
    ours = next(r for r in slow if r["policy"] == "resihp")
    assert ours["samples_per_s"] >= max(r["samples_per_s"] for r in slow)
    assert out["targets"][0]["target"].startswith("ours >= every baseline")


def test_plan_cli_explains_and_emits_the_ir(tmp_path, capsys):
    assert main(["plan", "--example", "llama2-7b"]) == 0
    path = tmp_path / "state.json"
    path.write_text(capsys.readouterr().out)
    assert main(["plan", str(path)]) == 0
    text = capsys.readouterr().out
    assert "exclusion:" in text and "standbys:" in text
    assert main(["plan", str(path), "--json"]) == 0
    plan = ParallelPlan.from_json(capsys.readouterr().out)
    assert plan.actions and 1 not in plan.ranks  # the example's lost GPU is out


def test_plan_cli_names_a_bad_state(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert main(["plan", str(bad)]) == 2
    assert "not a cluster state" in capsys.readouterr().err


def test_bench_plan_scale_section_alone(capsys):
    """`--sections scale` runs only the planning-time part: no model rows, one planning-time
    row per size, the 256-GPU plan checked valid (no timing is asserted: it is a benchmark)."""
    rc = main(["bench", "plan", "--json", "--sections", "scale", "--scale-repeats", "1"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["results"] == []
    assert [t["target"] for t in out["targets"]] == [  # only what this run decides
        "planning <= 1 s at 256 GPUs, <= 5 s at 4,096 (wall)"
    ]
    rows = {r["gpus"]: r for r in out["planning_time"]}
    assert set(rows) == {256, 4096}
    assert rows[256]["valid"]
    assert rows[256]["full_simulation_s"] == pytest.approx(rows[256]["predicted_s"], rel=1e-9)
    assert all(r["simulations"] > 0 and r["plan_cpu_s"] > 0 for r in rows.values())
