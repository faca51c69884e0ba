"""Fault campaign per optimizer: real trainer processes on gloo, a kill inside the update phase
(in the middle of the chunk transactions), recovered in place from retained memory — the final
state is bit-identical to the fault-free reference run, and nothing was recomputed. Muon's kill
lands in its second pass, after part of the orthogonalized update was committed: the
replacement trainer derives the directions again from retained state and finishes."""

from __future__ import annotations

import json

import pytest
import torch

from unbroken.api import run_job
from unbroken.engine.replica import build_training
from unbroken.metrics.log import read_jsonl

from ..foundation.conftest import tiny_job, with_faults
from ._rig import with_train


def _kill(cfg, optimizer: str) -> str:
    if optimizer != "muon":
        return "kill:rank=1,iter=3,phase=update"  # the middle transaction
    b = build_training(cfg, n_shards=1, device=torch.device("cpu"))
    n = len(b.geometry.chunks())
    assert b.step.passes == 2
    return f"kill:rank=1,iter=3,phase=update,step={n + n // 2}"


# CI runs Muon (two passes, the whole-matrix step between them: the hardest resume); SGD and
# Lion are in the slow tier — their chunk step's resume from every stage runs in the CI tier
# in test_resume.py (one process, a fresh updater finishing a torn update)
@pytest.mark.parametrize(
    "optimizer",
    [
        pytest.param("sgd", marks=pytest.mark.slow),
        pytest.param("lion", marks=pytest.mark.slow),
        "muon",
    ],
)
def test_kill_inside_the_update_recovers_in_place_bit_exact(tmp_path, optimizer):
    cfg = with_train(tiny_job(iterations=5, interval=0), optimizer=optimizer)
    cfg = with_faults(cfg, [_kill(cfg, optimizer)])
    s = run_job(cfg, tmp_path, reference=True, quiet=True)
    assert json.loads((tmp_path / "config.json").read_text())["train"]["optimizer"] == optimizer
    assert s["failures_injected"] == 1 and s["failures_recovered"] == 1
    (rec,) = s["recoveries"]
    assert rec["mode"] == "inplace" and rec["phase"] == "update"
    assert rec["recompute_s"] == 0.0 and rec["restored_iter"] == rec["iteration"] + 1
    assert s["bit_exact"] is True and s["per_iteration_mismatches"] == []
    repairs = [e for e in read_jsonl(tmp_path / "events.jsonl") if e["kind"] == "inplace_repair"]
    assert any(e["fixup"].startswith("restored chunk") for e in repairs if e["rank"] == 1)
