"""Variable-length (per-document) attention execution of the reference model, for the bench.

The reference `Transformer.forward` builds a dense N x N block-diagonal mask and runs masked
SDPA: its attention costs N^2 whatever the documents, so on CPU its micro-batch time does not
depend on sum l_i^2 (measured: constant within noise at N = 2048). GPU training runs packed
micro-batches with varlen attention kernels (FlashAttention's `cu_seqlens`), whose cost is
sum l_i^2 — the regime ResiHP's workload model and this detector are about. `varlen_loss` runs
the *same* parameters and math (identical loss up to float summation order) one document at a
time with causal SDPA, so its cost follows alpha * N + beta * sum l_i^2 on CPU too. It is a
`LossFn` for `Trainer(loss_fn=...)`; it never changes the model or its state.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from unbroken.data.packing import IGNORE_INDEX
from unbroken.model.llama import rope

__all__ = ["varlen_loss"]


def _attention(attn: nn.Module, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    a, t = attn.a, x.shape[0]
    q = rope(attn.wq(x).view(t, a.n_heads, a.head_dim), positions, a.rope_theta)
    k = rope(attn.wk(x).view(t, a.n_kv_heads, a.head_dim), positions, a.rope_theta)
    v = attn.wv(x).view(t, a.n_kv_heads, a.head_dim)
    rep = a.n_heads // a.n_kv_heads
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    q, k, v = (y.transpose(0, 1).float() for y in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return out.transpose(0, 1).reshape(t, -1).type_as(x)


def varlen_loss(model: nn.Module, mb: Any, device: torch.device) -> torch.Tensor:
    """Mean token loss of the (dense) reference model on a packed `MicroBatch`.

    Raises:
        ValueError: an MoE model (not supported here).
    """
    if getattr(model.args, "moe_experts", 0):
        raise ValueError("varlen_loss supports the dense reference model only")
    tokens, targets, positions = (
        t.to(device, non_blocking=True) for t in (mb.tokens, mb.targets, mb.positions)
    )
    lengths = [int(x) for x in mb.doc_lengths]
    x = model.embed(tokens)
    for layer in model.layers:
        h = layer.attn_norm(x)
        parts = [
            _attention(layer.attn, hs, ps)
            for hs, ps in zip(h.split(lengths), positions.split(lengths), strict=True)
        ]
        x = x + layer.attn.wo(torch.cat(parts))
        x = x + layer.ffn(layer.ffn_norm(x))
    logits = model.head(model.norm(x)).float()
    loss = F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")
    return loss / (targets != IGNORE_INDEX).sum().clamp(min=1)
