"""Causal attention within the documents of a packed micro-batch, without a T x T mask.

On a CUDA device under bf16/fp16 autocast the reference model attends with one of two kernels,
each computing exactly the block-diagonal causal mask of the dense path, with the softmax in
fp32 inside the kernel and O(T) memory instead of O(T^2):

- "varlen": variable-length flash attention (`torch.nn.attention.varlen.varlen_attn`): the
  packed tokens are one batch of `n` sequences described by their cumulative lengths
  (`cu_seqlens`, int32 [n + 1]), each attending causally to itself only;
- "flex": FlexAttention (`torch.nn.attention.flex_attention`, compiled by Inductor) with a
  block mask of the documents: tiles outside every document are skipped. Its backward has no
  atomics, so it stays fast under `torch.use_deterministic_algorithms(True)`, which the
  trainers set (FlashAttention's deterministic backward is about 3x its forward).

Owns the `Documents` value (where the documents start) and the kernel call; never builds a
dense mask and never reads the device back when the caller passes the document lengths (a
host sync per micro-batch would stall the launch queue between backward and forward).
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch

__all__ = ["KERNELS", "Documents", "document_attention", "uses_documents"]

_HALF = (torch.bfloat16, torch.float16)
KERNELS = ("varlen", "flex")


def uses_documents(device: torch.device) -> bool:
    """Whether the model attends by documents here: a CUDA device with half-precision autocast
    on (the flash kernels take bf16/fp16 only; an fp32 GPU run keeps the dense reference)."""
    if device.type != "cuda" or not torch.is_autocast_enabled("cuda"):
        return False
    return torch.get_autocast_dtype("cuda") in _HALF and _have_varlen()


@cache
def _have_varlen() -> bool:
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass(frozen=True, slots=True)
class Documents:
    """The documents of one packed micro-batch of T tokens, for one kernel.

    Attributes:
        cu_seqlens: int32 [n + 1] on the compute device: document i is tokens
            [cu_seqlens[i], cu_seqlens[i + 1]).
        max_len: the longest document (a bound the varlen kernel sizes its grid with).
        block_mask: FlexAttention's block mask of the documents ("flex" only).
    """

    cu_seqlens: torch.Tensor
    max_len: int
    block_mask: Any = None

    @classmethod
    def of(
        cls, doc_lengths: Sequence[int] | None, segment_ids: torch.Tensor, kernel: str = "varlen"
    ) -> Documents:
        """From the host-side lengths when given (no device read), else from `segment_ids`
        (one device-to-host read: fine for warm-ups and tests, not for the training loop)."""
        if kernel not in KERNELS:
            raise ValueError(f"attention kernel {kernel!r} is not one of {KERNELS}")
        device = segment_ids.device
        if doc_lengths is None:
            change = torch.nonzero(segment_ids[1:] != segment_ids[:-1]).flatten() + 1
            ends = torch.cat([change, change.new_tensor([segment_ids.numel()])]).cpu()
            starts = torch.cat([ends.new_zeros(1), ends[:-1]])
            doc_lengths = (ends - starts).tolist()
        if sum(doc_lengths) != segment_ids.numel():
            raise ValueError(
                f"document lengths sum to {sum(doc_lengths)}, the micro-batch has "
                f"{segment_ids.numel()} tokens"
            )
        cu = torch.tensor([0, *itertools.accumulate(doc_lengths)], dtype=torch.int32)
        if device.type == "cuda":
            cu = cu.pin_memory().to(device, non_blocking=True)
        mask = _block_mask(segment_ids) if kernel == "flex" else None
        return cls(cu, int(max(doc_lengths)), mask)


def _block_mask(segment_ids: torch.Tensor):
    from torch.nn.attention.flex_attention import create_block_mask

    docs = segment_ids

    def same_document_causal(b, h, q, kv):
        return (docs[q] == docs[kv]) & (q >= kv)

    t = segment_ids.numel()
    return create_block_mask(same_document_causal, None, None, t, t, device=segment_ids.device)


_COMPILED_FLEX: list = []


def _flex():
    """FlexAttention compiled once per process (eager flex materializes the scores)."""
    if not _COMPILED_FLEX:
        from torch.nn.attention.flex_attention import flex_attention

        _COMPILED_FLEX.append(torch.compile(flex_attention, dynamic=False))
    return _COMPILED_FLEX[0]


@cache
def _kernel_kwargs(grouped: bool) -> dict:
    """Keyword arguments of `varlen_attn` for causal attention (and shared key/value heads),
    across the torch versions that have it: older ones take `is_causal`, newer ones a
    `window_size` of (-1, 0); `enable_gqa` is absent from the oldest (the caller then repeats
    the key/value heads)."""
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    kwargs: dict = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    if grouped and "enable_gqa" in params:
        kwargs["enable_gqa"] = True
    return kwargs


def document_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: Documents
) -> torch.Tensor:
    """Causal attention of q [T, H, hd] over k, v [T, Hkv, hd] within each document.

    Grouped-query heads (Hkv dividing H) share their key/value head, as in the dense path.
    Returns [T, H, hd] in q's dtype, by the kernel `docs` was made for.
    """
    if docs.block_mask is not None:
        return _flex_attention(q, k, v, docs)
    return _varlen_attention(q, k, v, docs)


def _flex_attention(q, k, v, docs: Documents) -> torch.Tensor:
    # [T, H, hd] -> [1, H, T, hd] views; inside a compiled block the call is traced in place.
    qb, kb, vb = (y.transpose(0, 1).unsqueeze(0) for y in (q, k, v))
    grouped = q.shape[1] != k.shape[1]
    out = _flex()(qb, kb, vb, block_mask=docs.block_mask, enable_gqa=grouped)
    return out.squeeze(0).transpose(0, 1)


def _varlen_attention(q, k, v, docs: Documents) -> torch.Tensor:
    return _varlen_outside_graphs()(q, k, v, docs)


@cache
def _varlen_outside_graphs():
    """`_varlen` kept out of torch.compile graphs (the number of documents changes between
    micro-batches). Wrapped on first use: `torch.compiler.disable` imports dynamo (~1.3 s),
    which a CPU process never needs."""
    return torch.compiler.disable(_varlen)


def _varlen(q, k, v, docs: Documents) -> torch.Tensor:
    from torch.nn.attention.varlen import varlen_attn

    rep = q.shape[1] // k.shape[1]
    kwargs = _kernel_kwargs(rep > 1)
    if rep > 1 and "enable_gqa" not in kwargs:
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    cu, n = docs.cu_seqlens, docs.max_len
    return varlen_attn(q, k, v, cu, cu, n, n, **kwargs)
