"""Variable-length (per-document) attention execution of the reference model, for the bench.

The reference `Transformer.forward` builds a dense N x N block-diagonal mask and runs masked
SDPA: its attention costs N^2 whatever the documents, so on CPU its micro-batch time does not
depend on sum l_i^2 (measured: constant within noise at N = 2048). GPU training runs packed
micro-batches with varlen attention kernels (FlashAttention's `cu_seqlens`), whose cost is
sum l_i^2 — the regime ResiHP's workload model and this detector are about. `varlen_loss` runs
the *same* parameters and math (identical loss up to float summation order) with causal SDPA
within each document — the documents of one length batched into one call — so its cost follows
alpha * N + beta * sum l_i^2 on CPU too. On a CUDA
device one call of torch's FlashAttention varlen kernel (`torch.nn.attention.varlen`) runs all
documents of the micro-batch at once, as GPU training does: one launch per layer, not one per
document, so the cost has no per-document launch term. It is a `LossFn` for
`Trainer(loss_fn=...)`; it never changes the model or its state.
"""

from __future__ import annotations

import inspect
import itertools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from unbroken.data.packing import IGNORE_INDEX
from unbroken.model.llama import rope

__all__ = ["varlen_loss"]


def _qkv(attn: nn.Module, x: torch.Tensor, positions: torch.Tensor):
    """Queries, keys, values [T, H, D] of x [T, dim], RoPE applied, KV heads repeated."""
    a, t = attn.a, x.shape[0]
    q = rope(attn.wq(x).view(t, a.n_heads, a.head_dim), positions, a.rope_theta)
    k = rope(attn.wk(x).view(t, a.n_kv_heads, a.head_dim), positions, a.rope_theta)
    v = attn.wv(x).view(t, a.n_kv_heads, a.head_dim)
    rep = a.n_heads // a.n_kv_heads
    return q, k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)


def _grouped_attention(
    attn: nn.Module, x: torch.Tensor, positions: torch.Tensor, lengths: list[int]
) -> torch.Tensor:
    """Causal attention within each document of x [T, dim], one SDPA call per distinct
    document length (the documents of a length batched), so the cost is sum l_i^2 plus a
    call overhead per length, not per document."""
    q, k, v = _qkv(attn, x, positions)
    starts: dict[int, list[int]] = {}
    offset = 0
    for n in lengths:
        starts.setdefault(n, []).append(offset)
        offset += n
    order, outs = [], []
    for n, firsts in starts.items():
        idx = (torch.tensor(firsts)[:, None] + torch.arange(n)[None, :]).reshape(-1)
        qg, kg, vg = (y[idx].view(len(firsts), n, *y.shape[1:]).transpose(1, 2) for y in (q, k, v))
        out = F.scaled_dot_product_attention(qg.float(), kg.float(), vg.float(), is_causal=True)
        outs.append(out.transpose(1, 2).reshape(len(firsts) * n, -1))
        order.append(idx)
    inverse = torch.argsort(torch.cat(order))
    return torch.cat(outs)[inverse].type_as(x)


def _causal_kwargs(fn) -> dict[str, Any]:
    """How this torch's `varlen_attn` asks for causal attention (`window_size=(-1, 0)`; the
    first releases of the API had `is_causal`)."""
    params = inspect.signature(fn).parameters
    if "window_size" in params:
        return {"window_size": (-1, 0)}
    if "is_causal" in params:
        return {"is_causal": True}
    raise RuntimeError("torch.nn.attention.varlen.varlen_attn takes no causal flag")


def _varlen_attention(
    attn: nn.Module, x: torch.Tensor, positions: torch.Tensor, lengths: list[int]
) -> torch.Tensor:
    """All documents of x [T, dim] in one FlashAttention varlen call (CUDA, bf16/fp16)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError as exc:  # torch < 2.9
        raise RuntimeError("varlen_loss on a GPU needs torch >= 2.9 (varlen_attn)") from exc
    dtype = x.dtype if x.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
    q, k, v = (y.to(dtype) for y in _qkv(attn, x, positions))
    # Pinned, so the copy is queued behind the GPU's work instead of waiting for it (a
    # pageable copy would synchronize the host with the stream once per layer).
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32).pin_memory()
    cu = cu.to(x.device, non_blocking=True)
    longest = max(lengths)
    out = varlen_attn(q, k, v, cu, cu, longest, longest, **_causal_kwargs(varlen_attn))
    return out.reshape(x.shape[0], -1).type_as(x)


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
        if x.is_cuda:
            attended = _varlen_attention(layer.attn, h, positions, lengths)
        else:
            attended = _grouped_attention(layer.attn, h, positions, lengths)
        x = x + layer.attn.wo(attended)
        x = x + layer.ffn(layer.ffn_norm(x))
    logits = model.head(model.norm(x)).float()
    loss = F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")
    return loss / (targets != IGNORE_INDEX).sum().clamp(min=1)
