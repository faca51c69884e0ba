"""What the GPU updater tests share: a small model's state on 64 KiB pages with both parity
tiers (two groups, several chunks a group), the step's scalars, a hook that does nothing."""

from __future__ import annotations

import pytest
import torch

from unbroken.config import DataConfig, JobConfig, ModelConfig, ProtectionConfig, TrainConfig

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
PROT = ProtectionConfig(
    page_bytes=1 << 16, stripe_pages=4, chunk_bytes=1 << 14, parity_pages=3, second_tier_pages=1
)
CFG = JobConfig(
    model=ModelConfig(preset="small"),
    data=DataConfig(tokens_per_microbatch=256, microbatches=1, max_documents=50),
    train=TrainConfig(iterations=4, device="cuda", precision="fp32"),
    protection=PROT,
)
LR, SCALE = 1e-3, 0.7


def noop(*args) -> None:
    return None
