"""A user's own model factory and dataset, by import path, trained through a crash, exactly."""

import dataclasses
from pathlib import Path

import pytest

from unbroken.api import run_job
from unbroken.config import JobConfig, load_config

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "own_model" / "config.toml"


@pytest.mark.slow  # 25 s: CI time; CI keeps own models' in-place recovery (dropout, tied)
def test_own_model_example_recovers_bit_exact(tmp_path):
    cfg = load_config(JobConfig, EXAMPLE)
    cfg = dataclasses.replace(
        cfg,
        train=dataclasses.replace(cfg.train, iterations=12),
        inject=["kill:rank=1,iter=7,phase=update"],
    )
    s = run_job(cfg, tmp_path, reference=True, search_path=[str(EXAMPLE.parent)], quiet=True)
    assert s["failures_recovered"] == 1
    assert s["bit_exact"] is True
    assert s["faulty"]["final_loss"] < 4.0  # it learned something (log(128) = 4.85 at start)


# CI runs the in-place mode; a checkpoint restart reseeds dropout the same way (per
# micro-batch key, `unbroken.train.rng`) and is in the slow tier
@pytest.mark.parametrize("mode", [pytest.param("ckpt_restart", marks=pytest.mark.slow), "inplace"])
def test_a_model_with_dropout_recovers_bit_exact(tmp_path, mode):
    # Dropout draws from torch's global generator. The restarted trainer (from a checkpoint) or
    # the shadow (in place) starts with a generator in another state than the fault-free
    # run's at that iteration; per-micro-batch seeding (`unbroken.train.rng`) makes them draw
    # the same masks.
    cfg = load_config(JobConfig, EXAMPLE)
    cfg = dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, factory="_dropout_mlp:build", factory_args={}),
        train=dataclasses.replace(cfg.train, iterations=10),
        recovery=dataclasses.replace(cfg.recovery, mode=mode),
        inject=["kill:rank=1,iter=7,phase=backward"],
    )
    search = [str(EXAMPLE.parent), str(Path(__file__).parent)]
    s = run_job(cfg, tmp_path, reference=True, search_path=search, quiet=True)
    assert s["failures_recovered"] == 1
    assert s["recoveries"][0]["mode"] == mode
    assert s["bit_exact"] is True
    assert s["per_iteration_mismatches"] == []
