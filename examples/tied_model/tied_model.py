"""A small weight-tied language model trained under unbroken (docs/own-model.md, "Shared,
frozen and no-decay parameters").

It uses every kind of parameter that needs care in flat storage:

- **tied weights**: the output head is the token embedding (`self.head.weight =
  self.embed.weight`, GPT-2's weight tying): one parameter under two names, `embed.weight` and
  `head.weight`, stored, updated and checkpointed once;
- **a module used twice**: `blocks` lists the same residual block `depth` times (ALBERT-style
  sharing across depth), so its parameters are reachable as `blocks.0.*`, `blocks.1.*`, ...;
- **a frozen parameter**: with `freeze_positions = true` the position table is fixed at its
  initial values (`requires_grad=False`): kept, checkpointed and restored, never updated;
- **no-decay groups**: the config exempts the embedding (`train.no_decay = ["embed.weight"]`);
  norm weights and biases never decay.

The dataset: synthetic arithmetic sentences ("12+7=19."), a pure function of
(seed, iteration, shard, micro-batch), as every unbroken dataset must be.
"""

from __future__ import annotations

import torch
from torch import nn

CONTEXT = 16
VOCAB = 128


class Block(nn.Module):
    """Pre-norm residual MLP."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class TiedCharModel(nn.Module):
    """Predicts the next character from the previous CONTEXT characters."""

    def __init__(self, dim: int = 64, depth: int = 2, freeze_positions: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.positions = nn.Parameter(0.02 * torch.randn(CONTEXT, dim))
        self.positions.requires_grad_(not freeze_positions)
        self.mix = nn.Linear(CONTEXT * dim, dim)
        block = Block(dim)
        self.blocks = nn.ModuleList([block] * depth)  # one block, used `depth` times
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied: one parameter, two names

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Takes one micro-batch (a dict of tensors), returns its mean loss."""
        x = self.embed(batch["context"]) + self.positions
        h = self.mix(x.flatten(1))
        for block in self.blocks:
            h = block(h)
        return nn.functional.cross_entropy(self.head(self.norm(h)), batch["next"])


def build(dim: int = 64, depth: int = 2, freeze_positions: bool = False) -> nn.Module:
    """The factory named in config.toml as `model.factory = "tied_model:build"`."""
    return TiedCharModel(dim, depth, freeze_positions)


class ArithmeticDataset:
    """Micro-batches of (context, next char) pairs from random sums; pure in its arguments."""

    def __init__(self, data_cfg, n_shards: int) -> None:
        self.seed = data_cfg.seed
        self.microbatches = data_cfg.microbatches
        self.rows = data_cfg.tokens_per_microbatch
        self.n_shards = n_shards

    def _micro_batch(self, iteration: int, shard: int, index: int) -> dict[str, torch.Tensor]:
        key = ((self.seed * 1_000_003 + iteration) * 1_009 + shard) * 1_013 + index
        gen = torch.Generator().manual_seed(key & 0x7FFF_FFFF)
        a = torch.randint(0, 100, (self.rows,), generator=gen)
        b = torch.randint(0, 100, (self.rows,), generator=gen)
        text = "".join(f"{x}+{y}={x + y}." for x, y in zip(a.tolist(), b.tolist(), strict=True))
        codes = torch.tensor([ord(c) for c in text], dtype=torch.int64)
        starts = torch.arange(0, len(codes) - CONTEXT - 1)[: self.rows]
        context = torch.stack([codes[s : s + CONTEXT] for s in starts.tolist()])
        return {"context": context, "next": codes[starts + CONTEXT]}

    def iteration(self, iteration: int, shard: int) -> list[dict[str, torch.Tensor]]:
        return [self._micro_batch(iteration, shard, m) for m in range(self.microbatches)]
