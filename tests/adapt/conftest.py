"""Jobs that re-plan: the tiny job of the foundation tests with `adapt.enabled`."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from tests.foundation.conftest import tiny_job
from unbroken.api import run_job
from unbroken.config import AdaptConfig, JobConfig, ParallelConfig
from unbroken.metrics.log import read_jsonl


def adapt_job(
    *, world_size: int = 4, iterations: int = 8, inject=(), microbatches: int = 2, **adapt
) -> JobConfig:
    """The foundation tests' tiny job on `world_size` ranks with `microbatches` per shard,
    re-planning (no periodic checkpoint after the first: a checkpoint load would show)."""
    cfg = tiny_job(world_size=world_size, iterations=iterations, inject=list(inject), interval=1000)
    data = dataclasses.replace(cfg.data, microbatches=microbatches)
    return dataclasses.replace(cfg, data=data, adapt=AdaptConfig(enabled=True, **adapt))


def pp2_job(*, iterations: int, inject=(), n_layers: int | None = None, **adapt) -> JobConfig:
    """`adapt_job` on PP = 2 x DP = 2 over 4 ranks with 4 micro-batches per shard (the tiny
    model, with `n_layers` when given: 4 lets a replica's layers move between its stages)."""
    cfg = adapt_job(world_size=4, iterations=iterations, microbatches=4, inject=inject, **adapt)
    model = dataclasses.replace(cfg.model, n_layers=n_layers) if n_layers else cfg.model
    return dataclasses.replace(cfg, model=model, parallel=ParallelConfig(world_size=4, pp=2))


def crash_recovered_after_exclusion(cfg: JobConfig, run_dir: Path) -> tuple[dict, dict]:
    """`cfg` (a slow device excluded, then a trainer killed) run bit-exact beside its reference,
    asserting no checkpoint load, one re-plan and the kill recovered in place. Returns that
    re-plan and the `plan_applied` event of each generation."""
    s, events = run_bit_exact(cfg, run_dir)
    assert not events_of(events, "checkpoint_loaded")
    (replan,) = events_of(events, "replan")
    (failure,) = [r for r in s["recoveries"] if r.get("fault") == "kill"]
    assert failure["mode"] == "inplace"
    return replan, {e["generation"]: e for e in events_of(events, "plan_applied")}


def events_of(summary_events: list[dict], kind: str) -> list[dict]:
    return [e for e in summary_events if e["kind"] == kind]


def run_bit_exact(cfg: JobConfig, run_dir: Path) -> tuple[dict, list[dict]]:
    """`cfg` run beside its fault-free reference: its summary, after asserting the run is done
    and bit for bit the reference at every iteration, and the faulty run's events."""
    s = run_job(cfg, run_dir, reference=True, quiet=True)
    assert s["state"] == "done", s["reason"]
    assert s["bit_exact"] is True and s["per_iteration_mismatches"] == []
    return s, [e for e in read_jsonl(run_dir / "events.jsonl") if e["run"] == "faulty"]
