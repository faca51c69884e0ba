"""On a GPU with `recovery.shadow_warmup = "after_trainer"`, a shadow's kernel warm-up waits until
the trainer it would replace has completed an iteration (the agent's `WarmUp`): after a
takeover, the successor shadows warm up after the promoted trainer's first iteration, not beside
it; the job still recovers both kills through shadows, bit-exact."""

from __future__ import annotations

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

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _cuda():
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


def test_successor_shadows_warm_up_after_the_promoted_trainers_first_iteration(tmp_path):
    # The second kill comes ~300 iterations after the first (seconds on the tiny model), so the
    # first takeover's successor shadow is told to warm up by the promoted trainer's first
    # iteration, not by its own promotion (a Promote that comes first also ends the wait).
    cfg = JobConfig(
        model=ModelConfig(preset="tiny"),
        data=DataConfig(tokens_per_microbatch=256, microbatches=2, max_documents=200),
        train=TrainConfig(iterations=400, lr=1e-3, device="cuda", precision="bf16"),
        parallel=ParallelConfig(world_size=1),
        checkpoint=CheckpointConfig(interval=0),
        recovery=RecoveryConfig(mode="inplace", shadow_level=3, shadow_warmup="after_trainer"),
        inject=["kill:rank=0,iter=3,phase=update", "kill:rank=0,iter=300,phase=backward"],
    )
    s = run_job(cfg, tmp_path, reference=True, quiet=True)
    assert s["state"] == "done" and s["bit_exact"]
    events = read_jsonl(tmp_path / "events.jsonl")
    rows = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if r.get("run") == "faulty"]
    first_end = {}  # generation -> when its trainer completed its first iteration
    for r in rows:
        first_end.setdefault(r["generation"], r["t_end"])
    faulty = [e for e in events if e.get("run") == "faulty"]
    promoted = {e["generation"]: e["t"] for e in faulty if e["kind"] == "shadow_promoted"}
    assert sorted(promoted) == [1, 2]
    ready = {e["generation"]: e for e in faulty if e["kind"] == "shadow_ready"}
    assert set(ready) >= {1, 2}, sorted(ready)
    for generation, e in ready.items():
        go = e["t"] - e["prepare_s"] + e["steps_s"]["warm_go"]
        # Told once the trainer of the generation before had completed an iteration (its
        # heartbeat says so after the row is written: the go comes after the row's end).
        assert go >= first_end[generation - 1], e
        assert e["steps_s"]["warm"] >= e["steps_s"]["warm_go"]
    # The first takeover's successor: told by the promoted trainer's first iteration, before
    # its own promotion.
    e = ready[2]
    assert e["t"] - e["prepare_s"] + e["steps_s"]["warm_go"] < promoted[2], e
