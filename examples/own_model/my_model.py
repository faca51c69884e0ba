"""A user's own model and dataset trained under unbroken (see docs/own-model.md).

The model: a small character-level MLP language model over a fixed context window.
The dataset: synthetic arithmetic sentences ("12+7=19."), generated as a pure function of
(seed, iteration, shard, micro-batch) — the one rule a dataset must follow so that a redone
iteration sees the same inputs on any process.
"""

from __future__ import annotations

import torch
from torch import nn

CONTEXT = 16
VOCAB = 128


class CharMLP(nn.Module):
    """Predicts the next character from the previous CONTEXT characters."""

    def __init__(self, hidden: int = 256) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        self.net = nn.Sequential(
            nn.Linear(32 * CONTEXT, hidden), nn.GELU(), nn.Linear(hidden, VOCAB)
        )

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Takes one micro-batch (a dict of tensors), returns its mean loss."""
        x = self.embed(batch["context"]).flatten(1)
        return nn.functional.cross_entropy(self.net(x), batch["next"])


def build(hidden: int = 256) -> nn.Module:
    """The model factory named in config.toml as `model.factory = "my_model:build"`."""
    return CharMLP(hidden)


class ArithmeticDataset:
    """Micro-batches of (context, next char) pairs from random sums; pure in its arguments."""

    def __init__(self, data_cfg, n_shards: int) -> None:
        self.seed = data_cfg.seed
        self.microbatches = data_cfg.microbatches
        self.rows = data_cfg.tokens_per_microbatch
        self.n_shards = n_shards

    def _micro_batch(self, iteration: int, shard: int, index: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(
            hash((self.seed, iteration, shard, index)) & 0x7FFF_FFFF
        )
        a = torch.randint(0, 100, (self.rows,), generator=gen)
        b = torch.randint(0, 100, (self.rows,), generator=gen)
        text = "".join(f"{x}+{y}={x + y}." for x, y in zip(a.tolist(), b.tolist(), strict=True))
        codes = torch.tensor([ord(c) for c in text], dtype=torch.int64)
        starts = torch.arange(0, len(codes) - CONTEXT - 1)[: self.rows]
        context = torch.stack([codes[s : s + CONTEXT] for s in starts.tolist()])
        return {"context": context, "next": codes[starts + CONTEXT]}

    def iteration(self, iteration: int, shard: int) -> list[dict[str, torch.Tensor]]:
        return [self._micro_batch(iteration, shard, m) for m in range(self.microbatches)]
