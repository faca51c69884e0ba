"""Fail-slow detection on real hybrid-parallel jobs (`unbroken train` with parallel.tp/pp > 1,
gloo on the CPU): the engine's workers report their workload and timings, the coordinator's
watch predicts each iteration through the plan's simulator, and a `slow` rank is named with
its pipeline stage — among its TP peers too. The same plans without a fault raise no report."""

from __future__ import annotations

import json

import pytest

from unbroken.api import run_job
from unbroken.config import (
    CheckpointConfig,
    DataConfig,
    JobConfig,
    ModelConfig,
    ParallelConfig,
    RecoveryConfig,
    TrainConfig,
)
from unbroken.metrics.log import read_jsonl

FAULT_ITER = 13
"""After the watch's warm-up (2 skipped + 10 fitted iterations) and one healthy point."""


def _plan_job(tp: int, pp: int, inject=()) -> JobConfig:
    # 256-token micro-batches: compute, not the fixed per-iteration overhead, is most of an
    # iteration. No checkpoints, no retained state, no shadows: nothing but training.
    return JobConfig(
        model=ModelConfig(preset="tiny"),
        data=DataConfig(tokens_per_microbatch=256, microbatches=4, max_documents=200),
        train=TrainConfig(iterations=FAULT_ITER + 6, lr=1e-3),
        parallel=ParallelConfig(world_size=tp * pp, tp=tp, pp=pp),
        checkpoint=CheckpointConfig(enabled=False),
        recovery=RecoveryConfig(mode="ckpt_restart", shadow_level=0),
        inject=list(inject),
    )


def _trace(out) -> str:
    """What the fail-slow watch saw, for a failure message."""
    lines = [f"iter {m['iter']} {m['iter_s']:.3f}s" for m in read_jsonl(out / "metrics.jsonl")]
    lines += [
        json.dumps(e)
        for e in read_jsonl(out / "events.jsonl")
        if e["kind"] in ("change_point", "fail_slow", "detector_disabled", "slow_active")
    ]
    return "\n".join(lines)


def _watched(out) -> None:
    """The watch ran on the plan's own records (it did not switch itself off)."""
    events = list(read_jsonl(out / "events.jsonl"))
    assert not [e for e in events if e["kind"] == "detector_disabled"], _trace(out)
    rec = next(iter(read_jsonl(out / "timings.jsonl")))
    assert rec["compute"] and rec["microbatches"] and rec["doc_lengths"]


@pytest.mark.parametrize(
    ("tp", "pp", "rank", "stage"),
    [
        (1, 2, 1, 1),
        # TP2 x PP2 (~15 s on 2 cores) in the slow tier: CI keeps the stage naming on PP2
        pytest.param(2, 2, 1, 0, marks=pytest.mark.slow),
    ],
    ids=["pp2-rank1", "tp2xpp2-rank1"],
)
def test_a_slow_rank_of_a_plan_is_named_with_its_stage(tmp_path, tp, pp, rank, stage):
    # In TP2 x PP2, rank 1 is TP position 1 of stage 0: its TP peer (rank 0) waits for it in
    # every layer's collective, and must not be named.
    cfg = _plan_job(tp, pp, [f"slow:rank={rank},iter={FAULT_ITER},factor=8"])
    s = run_job(cfg, tmp_path, quiet=True)
    assert s["state"] == "done"
    _watched(tmp_path)
    reports = s["fail_slow"]
    assert [(r["rank"], r["stage"], r["what"]) for r in reports] == [(rank, stage, "compute")], (
        _trace(tmp_path)
    )
    (report,) = reports
    # The change point may take in one noisy iteration just before the fault: on this
    # session's VM (stop 46) it was placed at FAULT_ITER - 1 in 2 of ~10 runs of this test.
    assert FAULT_ITER - 1 <= report["since_iter"] <= report["detected_at"] <= FAULT_ITER + 3
    assert report["factor"] > 1.5


@pytest.mark.parametrize(
    ("tp", "pp"), [(1, 2), pytest.param(2, 2, marks=pytest.mark.slow)], ids=["pp2", "tp2xpp2"]
)
def test_a_plan_without_faults_raises_no_fail_slow_report(tmp_path, tp, pp):
    s = run_job(_plan_job(tp, pp), tmp_path, quiet=True)
    assert s["state"] == "done"
    _watched(tmp_path)
    assert s["fail_slow"] == [], _trace(tmp_path)
