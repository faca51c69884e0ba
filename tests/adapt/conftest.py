"""Jobs that re-plan: the tiny job of the foundation tests with `adapt.enabled`."""

from __future__ import annotations

import dataclasses

from tests.foundation.conftest import tiny_job
from unbroken.config import AdaptConfig, JobConfig


def adapt_job(
    *, world_size: int = 4, iterations: int = 8, inject=(), microbatches: int = 2, **adapt
) -> JobConfig:
    """The foundation tests' tiny job on `world_size` ranks with `microbatches` per shard,
    re-planning (no periodic checkpoint after the first: a checkpoint load would show)."""
    cfg = tiny_job(world_size=world_size, iterations=iterations, inject=list(inject), interval=1000)
    data = dataclasses.replace(cfg.data, microbatches=microbatches)
    return dataclasses.replace(cfg, data=data, adapt=AdaptConfig(enabled=True, **adapt))


def events_of(summary_events: list[dict], kind: str) -> list[dict]:
    return [e for e in summary_events if e["kind"] == kind]
