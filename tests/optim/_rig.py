"""Shared set-up of the optimizer tests: a tiny model's flat state under a chosen rule."""

from __future__ import annotations

import dataclasses

import torch

from unbroken.config import DataConfig, JobConfig, ModelConfig, ProtectionConfig, TrainConfig
from unbroken.engine.replica import Built, build_training

PROT = ProtectionConfig(page_bytes=4096, stripe_pages=2, parity_pages=3, chunk_bytes=1024)


def job(optimizer: str, **train) -> JobConfig:
    return JobConfig(
        model=ModelConfig(preset="tiny"),
        data=DataConfig(tokens_per_microbatch=64, microbatches=2, max_documents=100),
        train=TrainConfig(iterations=8, lr=1e-3, optimizer=optimizer, **train),
        protection=PROT,
    )


def built(optimizer: str, allocate=None, **train) -> Built:
    return build_training(
        job(optimizer, **train), n_shards=1, device=torch.device("cpu"), allocate=allocate
    )


def fake_grads(b: Built, iteration: int) -> None:
    """Deterministic gradients for `iteration` in every parameter's span (padding stays 0)."""
    gen = torch.Generator().manual_seed(1000 + iteration)
    b.state.grads.zero_()
    for s in b.state.layout.stored:
        b.state.grads[s.offset : s.offset + s.numel] = torch.randn(s.numel, generator=gen) * 1e-2


def with_train(cfg: JobConfig, **train) -> JobConfig:
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **train))
