"""The leto-fig14 preset (Leto Fig. 14 / App. B): rows, keys, and the paper's qualitative result,
with a check that the result comes from the modelled mechanisms."""

from __future__ import annotations

import dataclasses
import json

import pytest

from unbroken.cli.main import main
from unbroken.sim.ettr import closed_form
from unbroken.sim.policy import FailureMix, policy_terms
from unbroken.sim.scenario import evaluate, load_scenario

KEYS = {"model", "gpus", "mttf_s", "hof_ratio", "policy", "ettr", "t_iter_s", "t_rec_s",
        "ckpt_interval"}  # fmt: skip


@pytest.fixture(scope="module")
def rows():
    rows, skipped = evaluate(load_scenario(preset="leto-fig14"))
    return rows, skipped


def _by(rows):
    return {(r["model"], r["hof_ratio"], r["policy"]): r for r in rows}


def test_27_rows_with_the_required_keys(rows):
    rows, skipped = rows
    assert len(rows) == 27
    assert {r["model"] for r in rows} == {"deepseek-v2", "deepseek-v3", "deepseek-v4"}
    assert {r["gpus"] for r in rows} == {1024, 16384, 131072}
    assert {r["policy"] for r in rows} == {"inplace", "gemini+", "gemini"}
    assert {r["hof_ratio"] for r in rows} == {0.0, 0.5, 1.0}
    for r in rows:
        assert r.keys() >= KEYS
        assert 0.0 < r["ettr"] < 1.0
    # JIT is not applicable: Table 5 shards optimizer states.
    assert {s["policy"] for s in skipped} == {"jit"}


def test_in_place_leads_at_half_hofs_and_trails_little_at_none(rows):
    by = _by(rows[0])
    for model in ("deepseek-v2", "deepseek-v3", "deepseek-v4"):
        lead = by[(model, 0.5, "inplace")]["ettr"] - by[(model, 0.5, "gemini+")]["ettr"]
        trail = by[(model, 0.0, "gemini+")]["ettr"] - by[(model, 0.0, "inplace")]["ettr"]
        assert lead >= 0.03, (model, lead)
        assert 0.0 <= trail <= 0.005, (model, trail)
        # The advantage grows with the HOF ratio (Fig. 14).
        full = by[(model, 1.0, "inplace")]["ettr"] - by[(model, 1.0, "gemini+")]["ettr"]
        assert full > lead


def test_the_advantage_comes_from_the_modelled_mechanisms():
    """Give in-place recovery the checkpoint system's costs one mechanism at a time: each
    removal shrinks the lead, and with none left in-place is no better than Gemini+."""
    scenario = load_scenario(preset="leto-fig14")
    rec = scenario.recovery
    mix = FailureMix(mttf_s=600.0, hof_ratio=0.5)
    for wl in scenario.workloads:
        plus = closed_form(policy_terms("gemini+", wl.steps, mix, rec), mix).ettr
        base = policy_terms("inplace", wl.steps, mix, rec)
        lead = closed_form(base, mix).ettr - plus
        # 1. No state retention: a HOF rolls back like a checkpoint restart.
        hof_plus = policy_terms("gemini+", wl.steps, mix, rec).costs["hof"]
        rolled = dataclasses.replace(
            base, costs={**base.costs, "hof": dataclasses.replace(
                base.costs["hof"], lost_iters=base.costs["fatal"].lost_iters, rollback=True)}
        )  # fmt: skip
        lead_rolled = closed_form(rolled, mix).ettr - plus
        # 2. ...and no in-place preinitialization: the shadow takeover costs a spare's setup.
        neither = dataclasses.replace(rolled, costs={**rolled.costs, "hof": hof_plus})
        lead_neither = closed_form(neither, mix).ettr - plus
        assert lead > lead_rolled > lead_neither
        assert lead_neither <= 0.003  # what is left is the longer FF-only interval


def test_cli_json_prints_one_object_with_27_rows(capsys, tmp_path):
    png = tmp_path / "fig14.png"
    assert main(["simulate", "--preset", "leto-fig14", "--json", "--png", str(png)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert len(doc["rows"]) == 27
    assert png.stat().st_size > 10_000


def test_cli_longer_mttfs_of_appendix_b(capsys, tmp_path):
    args = ["simulate", "--preset", "leto-fig14", "--mttf", "30m,1h", "--json", "--no-png"]
    assert main(args) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {r["mttf_s"] for r in doc["rows"]} == {1800.0, 3600.0}
    by = {(r["model"], r["mttf_s"], r["hof_ratio"], r["policy"]): r["ettr"] for r in doc["rows"]}
    for (model, mttf, h, policy), ettr in by.items():
        if policy == "inplace" and h == 0.5:
            assert ettr > by[(model, mttf, h, "gemini+")]


def test_cli_table(capsys):
    assert main(["simulate", "--preset", "leto-fig14", "--no-png", "--policies", "inplace"]) == 0
    out = capsys.readouterr().out
    assert "deepseek-v4" in out and "131072" in out


def test_recovery_breakdown_adds_up(rows):
    for r in rows[0]:
        for kind, parts in r["recovery_by_kind"].items():
            assert sum(parts.values()) == pytest.approx(r["t_rec_by_kind_s"][kind])
