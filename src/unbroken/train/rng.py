"""Randomness inside a model as a pure function of where it is used.

Before each micro-batch's forward the trainer seeds torch's global generators (CPU and every
CUDA device: what `nn.Dropout`, `torch.rand` and noisy routers draw from) with a hash of
(train.seed, iteration, data shard, micro-batch index) — the key the sampler already uses for
the data. So a redone iteration, a restarted trainer, a shadow that takes over, or a
micro-batch that runs on another replica draws exactly the random numbers the fault-free run
drew, and recovery stays bit-exact for models with dropout. Nothing of a generator's state has
to survive a failure: a checkpoint records the seed (`rng_seed`, `unbroken.checkpoint.dcp`) and
the iteration, and those determine every later draw.

The reference model draws nothing during training; a user's model may (docs/own-model.md).
"""

from __future__ import annotations

import hashlib
import struct

import torch

__all__ = ["microbatch_seed", "seed_microbatch"]


def microbatch_seed(seed: int, iteration: int, shard: int, index: int) -> int:
    """A 63-bit seed, stable across processes, machines and Python versions (blake2b, not
    `hash`, whose value for some types changes per process)."""
    key = struct.pack("<4q", seed, iteration, shard, index)
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


def seed_microbatch(seed: int, iteration: int, shard: int, index: int) -> None:
    """Seed torch's global generators for micro-batch `index` of `iteration` on `shard`."""
    torch.manual_seed(microbatch_seed(seed, iteration, shard, index))
