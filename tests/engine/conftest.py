"""Fixtures shared by the engine tests."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch.distributed as dist


@pytest.fixture
def world(tmp_path):
    """A one-rank gloo group in this process (the worker's collectives need one)."""
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(str(tmp_path / "store"), 1),
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=30),
    )
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()
