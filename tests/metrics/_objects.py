"""A user's model factory and dataset for the Python-API tests, as objects a caller passes to
`unbroken.run_job` (top-level names of an importable module: they reach the trainers by
reference; the dataset instance by pickle)."""

from __future__ import annotations

import torch
from torch import nn

VOCAB = 64
CONTEXT = 8


class TinyLM(nn.Module):
    """Predicts the next token from the previous CONTEXT tokens."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.net = nn.Sequential(
            nn.Linear(16 * CONTEXT, hidden), nn.GELU(), nn.Linear(hidden, VOCAB)
        )

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return nn.functional.cross_entropy(self.net(self.embed(batch["x"]).flatten(1)), batch["y"])


def build(hidden: int = 32) -> nn.Module:
    return TinyLM(hidden)


class CountingDataset:
    """Sequences of (a + k*step) mod VOCAB; a configured *instance* (not a class) is what the
    test passes, so it reaches the trainers pickled. Pure in (seed, iteration, shard, index)."""

    def __init__(self, seed: int, rows: int, microbatches: int) -> None:
        self.seed, self.rows, self.microbatches = seed, rows, microbatches

    def iteration(self, iteration: int, shard: int) -> list[dict[str, torch.Tensor]]:
        out = []
        for m in range(self.microbatches):
            gen = torch.Generator().manual_seed(
                self.seed * 1_000_003 + iteration * 997 + shard * 31 + m
            )
            start = torch.randint(0, VOCAB, (self.rows, 1), generator=gen)
            step = torch.randint(1, 4, (self.rows, 1), generator=gen)
            seq = (start + step * torch.arange(CONTEXT + 1)) % VOCAB
            out.append({"x": seq[:, :CONTEXT], "y": seq[:, CONTEXT]})
        return out
