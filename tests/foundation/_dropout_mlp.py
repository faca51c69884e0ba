"""A user's model that draws random numbers while training (dropout), for the recovery tests.

Imported by the trainers through the job's search path (with examples/own_model for the
dataset), not as part of the test package.
"""

from __future__ import annotations

import torch
from my_model import CONTEXT, VOCAB
from torch import nn


class DropoutMLP(nn.Module):
    def __init__(self, hidden: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.net = nn.Sequential(
            nn.Linear(16 * CONTEXT, hidden), nn.GELU(), nn.Dropout(0.3), nn.Linear(hidden, VOCAB)
        )

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        x = self.embed(batch["context"]).flatten(1)
        return nn.functional.cross_entropy(self.net(x), batch["next"])


def build(hidden: int = 64) -> nn.Module:
    return DropoutMLP(hidden)
