"""A user's own model factory and dataset, by import path, trained through a crash, exactly."""

from pathlib import Path

from unbroken.api import run_job
from unbroken.config import JobConfig, load_config

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "own_model" / "config.toml"


def test_own_model_example_recovers_bit_exact(tmp_path):
    cfg = load_config(JobConfig, EXAMPLE)
    import dataclasses

    cfg = dataclasses.replace(
        cfg,
        train=dataclasses.replace(cfg.train, iterations=12),
        inject=["kill:rank=1,iter=7,phase=update"],
    )
    s = run_job(cfg, tmp_path, reference=True, search_path=[str(EXAMPLE.parent)], quiet=True)
    assert s["failures_recovered"] == 1
    assert s["bit_exact"] is True
    assert s["faulty"]["final_loss"] < 4.0  # it learned something (log(128) = 4.85 at start)
