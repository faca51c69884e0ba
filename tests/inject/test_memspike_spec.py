"""`memspike` specs: mb=N or over=N (exactly one), and over=N refused up front for a CPU job."""

from __future__ import annotations

import pytest

from unbroken.api import run_job
from unbroken.config import JobConfig, ParallelConfig, TrainConfig
from unbroken.errors import UserError
from unbroken.inject import parse_fault


def test_memspike_takes_mb_or_over_and_round_trips():
    spike = parse_fault("memspike:rank=0,iter=6,phase=forward,over=256")
    assert (spike.over, spike.mb) == (256, 0)
    assert parse_fault(spike.text()) == spike
    for bad in ("memspike:rank=0,iter=6", "memspike:rank=0,iter=6,mb=1,over=1"):
        with pytest.raises(UserError, match="exactly one of mb=N"):
            parse_fault(bad)


def test_over_on_a_cpu_job_is_a_one_line_user_error(tmp_path):
    cfg = JobConfig(
        train=TrainConfig(device="cpu"),
        parallel=ParallelConfig(world_size=1),
        inject=["memspike:rank=0,iter=2,over=64"],
    )
    with pytest.raises(UserError, match=r"this job trains on the CPU \(use mb=N\)") as err:
        run_job(cfg, tmp_path / "run")
    assert "\n" not in str(err.value)
    assert not (tmp_path / "run").exists()  # refused before anything started
