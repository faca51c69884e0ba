"""Shared helpers for foundation tests: a tiny job that runs real processes quickly."""

from __future__ import annotations

import dataclasses

import pytest

from unbroken.config import (
    CheckpointConfig,
    DataConfig,
    JobConfig,
    ModelConfig,
    ParallelConfig,
    ProtectionConfig,
    RecoveryConfig,
    TrainConfig,
)


def local_trainer(cfg: JobConfig, *, n_shards: int = 1, hooks=(), wrap_updater=None, **trainer_kw):
    """A one-process `Trainer` (shard 0, no group, CPU) on fresh local buffers with the plain
    updater (passed through `wrap_updater` when given), as most single-process tests build it.
    Returns (built, trainer)."""
    import torch

    from unbroken.engine.replica import build_training
    from unbroken.train import Trainer
    from unbroken.update import PlainUpdater

    built = build_training(cfg, n_shards=n_shards, device=torch.device("cpu"))
    trainer = Trainer(
        model=built.model,
        state=built.state,
        source=built.source,
        shard=0,
        cfg=cfg.train,
        group=None,
        device=torch.device("cpu"),
        hooks=list(hooks),
        updater=(wrap_updater or (lambda u: u))(
            PlainUpdater(built.state, built.geometry, built.step)
        ),
        **trainer_kw,
    )
    return built, trainer


def tiny_job(
    *,
    world_size: int = 2,
    iterations: int = 10,
    inject=(),
    interval: int = 3,
    mode: str = "inplace",
) -> JobConfig:
    return JobConfig(
        model=ModelConfig(preset="tiny"),
        data=DataConfig(tokens_per_microbatch=64, microbatches=2, max_documents=200),
        train=TrainConfig(iterations=iterations, lr=1e-3),
        parallel=ParallelConfig(world_size=world_size),
        checkpoint=CheckpointConfig(interval=interval),
        recovery=RecoveryConfig(heartbeat_interval_s=0.1, heartbeat_timeout_s=1.5, mode=mode),
        protection=ProtectionConfig(
            page_bytes=8192, stripe_pages=2, parity_pages=3, chunk_bytes=2048
        ),
        inject=list(inject),
    )


@pytest.fixture
def job_factory():
    return tiny_job


def with_faults(cfg: JobConfig, faults: list[str]) -> JobConfig:
    return dataclasses.replace(cfg, inject=faults)
