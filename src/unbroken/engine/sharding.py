"""How a full model's parameters map onto TP shards, by parameter name.

Owns the one table that says which dimension of each reference-model parameter is split across
a TP group (`split_dim`), and the conversions built on it: cut a full tensor into the shard of
TP position r of t (`shard_of`), load a rank's flat buffer from a full model's state
(`load_from_full`), and put shards back together (`unshard`). Resharding a layer from degree a
to b is `shard_of(unshard(shards_a), b)`; tests use `unshard` to compare a sharded run with
the single-process reference.

Shards are contiguous equal slices along the split dimension, in TP-position order, so the
shard of position r of t is the concatenation of the shards r·k .. r·k + k - 1 of degree t·k.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from unbroken.model.flat import FlatLayout

__all__ = ["load_from_full", "replicated", "shard_of", "split_dim", "unshard"]

_ROW_SPLIT = (
    "attn.wq.weight",
    "attn.wk.weight",
    "attn.wv.weight",
    "ffn.w1.weight",
    "ffn.w3.weight",
)
_COL_SPLIT = ("attn.wo.weight", "ffn.w2.weight")


def split_dim(name: str) -> int | None:
    """The dimension of parameter `name` split across the TP group; None when replicated."""
    if name in ("embed.weight", "head.weight") or name.endswith(_ROW_SPLIT):
        return 0
    if name.endswith(_COL_SPLIT):
        return 1
    return None


def replicated(name: str) -> bool:
    """True for parameters every TP position holds whole (the norm weights)."""
    return split_dim(name) is None


def shard_of(full: torch.Tensor, name: str, tp_size: int, tp_rank: int) -> torch.Tensor:
    """The slice of `full` that TP position `tp_rank` of `tp_size` holds (a view).

    Raises:
        ValueError: the split dimension is not divisible by `tp_size`.
    """
    dim = split_dim(name)
    if dim is None or tp_size == 1:
        return full
    n = full.shape[dim]
    if n % tp_size:
        raise ValueError(f"{name}: dimension {dim} of size {n} not divisible by TP {tp_size}")
    per = n // tp_size
    return full.narrow(dim, tp_rank * per, per)


def unshard(name: str, shards: Sequence[torch.Tensor]) -> torch.Tensor:
    """The full tensor from the shards of every TP position, in TP order."""
    dim = split_dim(name)
    if dim is None or len(shards) == 1:
        return shards[0].clone()
    return torch.cat(list(shards), dim=dim)


def load_from_full(
    full: Mapping[str, torch.Tensor],
    layout: FlatLayout,
    flat: torch.Tensor,
    tp_size: int,
    tp_rank: int,
) -> None:
    """Copy this rank's shard of every parameter in `layout` (copies of tied parameters
    included) from a full model's tensors by name (aliases included)."""
    views = layout.views(flat)
    with torch.no_grad():
        for slot in layout.stored:
            views[slot.name].copy_(shard_of(full[slot.name], slot.name, tp_size, tp_rank))
