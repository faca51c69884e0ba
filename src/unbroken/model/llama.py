"""Llama-style decoder: RMSNorm, RoPE, SwiGLU, grouped-query attention; optional top-k MoE.

Inputs are packed micro-batches: attention is block-diagonal causal over document segments and
RoPE positions restart at each document. The attention softmax runs in fp32. Nothing here owns
storage: `build_model(..., device="meta")` and `unbroken.model.flat.materialize` place the
parameters in caller-provided memory.

Two attention paths compute the same function (`Transformer.forward` picks one per call):
- dense (CPU, or a GPU without half-precision autocast): q, k, v upcast to fp32 and masked by
  the [T, T] block-diagonal causal mask — the reference, whose bits the CPU tests pin;
- documents (CUDA under bf16/fp16 autocast): variable-length flash attention over the packed
  documents (`unbroken.model.attention`), no T x T mask; the softmax still runs in fp32 inside
  the kernel. `compile_blocks` additionally compiles each block around that kernel.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from unbroken.config import ModelConfig
from unbroken.data.corpus import VOCAB_SIZE
from unbroken.data.packing import IGNORE_INDEX
from unbroken.errors import UserError
from unbroken.model.attention import Documents, document_attention, uses_documents
from unbroken.model.meta import skip_meta_init
from unbroken.model.presets import PRESETS

__all__ = [
    "TIED_EMBEDDINGS",
    "Transformer",
    "TransformerArgs",
    "build_model",
    "compile_blocks",
    "resolve_args",
]

TIED_EMBEDDINGS = ("embed.weight", "head.weight")
"""The names of the one parameter a model with `tie_embeddings` shares, its owner first (the
`tied` argument of `FlatLayout.of`)."""


@dataclass(frozen=True, slots=True)
class TransformerArgs:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab_size: int = VOCAB_SIZE
    moe_experts: int = 0
    moe_top_k: int = 2
    moe_aux_coef: float = 0.01
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    """The output head shares the embedding's weight ([Note: shared parameters])."""

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(f"model.dim={self.dim} must be divisible by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads}")
        if (self.dim // self.n_heads) % 2:
            raise ValueError("head dim (dim / n_heads) must be even for RoPE")
        if self.moe_experts and not 1 <= self.moe_top_k <= self.moe_experts:
            raise ValueError(f"moe_top_k must be in [1, moe_experts={self.moe_experts}]")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def tied(self) -> tuple[tuple[str, ...], ...]:
        """Groups of parameter names that are one parameter (`FlatLayout.of`'s `tied`)."""
        return (TIED_EMBEDDINGS,) if self.tie_embeddings else ()


def resolve_args(cfg: ModelConfig) -> TransformerArgs:
    """Preset plus explicit overrides → validated `TransformerArgs`.

    Raises:
        UserError: unknown preset or inconsistent sizes.
    """
    if cfg.preset not in PRESETS:
        raise UserError(f"model.preset {cfg.preset!r} is unknown; choose one of {sorted(PRESETS)}")
    fields = dict(PRESETS[cfg.preset])
    for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size"):
        if getattr(cfg, name) is not None:
            fields[name] = getattr(cfg, name)
    if cfg.moe_experts is not None:
        fields["moe_experts"] = cfg.moe_experts
    if cfg.moe_top_k is not None:
        fields["moe_top_k"] = cfg.moe_top_k
    fields["tie_embeddings"] = cfg.tie_embeddings
    try:
        args = TransformerArgs(**fields)
    except ValueError as exc:
        raise UserError(f"model: {exc}") from None
    if args.vocab_size < VOCAB_SIZE:
        raise UserError(f"model.vocab_size must be at least {VOCAB_SIZE} (byte-level tokens)")
    return replace(args)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, device=None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return out.type_as(x) * self.weight


Rotary = tuple[torch.Tensor, torch.Tensor]
"""RoPE's (cos, sin) tables of one micro-batch's positions, fp32 [T, 1, head_dim / 2]."""


def rotary(positions: torch.Tensor, head_dim: int, theta: float) -> Rotary:
    """The rotation tables at per-token positions [T] (restarting per document), computed
    once per micro-batch and shared by every layer: recomputed inside each layer they cost
    a sine and a cosine per element of q and k (compiled, 5 % of the 1b step on an H200)."""
    half = head_dim // 2
    device = positions.device
    inv = 1.0 / (theta ** (torch.arange(0, half, device=device, dtype=torch.float32) / half))
    ang = positions.to(torch.float32)[:, None] * inv[None, :]
    return ang.cos()[:, None, :], ang.sin()[:, None, :]


def apply_rotary(x: torch.Tensor, rot: Rotary) -> torch.Tensor:
    """Rotary embedding of x [T, H, D] by the tables `rot` of its tokens' positions."""
    cos, sin = rot
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).type_as(x)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding of x [T, H, D] at per-token positions [T] (restarting per document)."""
    return apply_rotary(x, rotary(positions, x.shape[-1], theta))


class Attention(nn.Module):
    def __init__(self, a: TransformerArgs, device=None) -> None:
        super().__init__()
        self.a = a
        hd = a.head_dim
        self.wq = nn.Linear(a.dim, a.n_heads * hd, bias=False, device=device)
        self.wk = nn.Linear(a.dim, a.n_kv_heads * hd, bias=False, device=device)
        self.wv = nn.Linear(a.dim, a.n_kv_heads * hd, bias=False, device=device)
        self.wo = nn.Linear(a.n_heads * hd, a.dim, bias=False, device=device)

    def forward(self, x: torch.Tensor, rot: Rotary, mask: torch.Tensor | Documents) -> torch.Tensor:
        a, t = self.a, x.shape[0]
        q = apply_rotary(self.wq(x).view(t, a.n_heads, a.head_dim), rot)
        k = apply_rotary(self.wk(x).view(t, a.n_kv_heads, a.head_dim), rot)
        v = self.wv(x).view(t, a.n_kv_heads, a.head_dim)
        if isinstance(mask, Documents):
            return self.wo(document_attention(q, k, v, mask).reshape(t, -1))
        rep = a.n_heads // a.n_kv_heads
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        # fp32 softmax (Leto A.1): compute attention in fp32 whatever the autocast dtype.
        q, k, v = (y.transpose(0, 1).float() for y in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.wo(out.transpose(0, 1).reshape(t, -1).type_as(x))


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int, device=None) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False, device=device)
        self.w3 = nn.Linear(dim, hidden, bias=False, device=device)
        self.w2 = nn.Linear(hidden, dim, bias=False, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoE(nn.Module):
    """Top-k routed SwiGLU experts with a Switch-style load-balancing loss.

    Experts run one after another on the tokens routed to them; `index_add_` accumulates in a
    fixed order so the layer is deterministic.
    """

    def __init__(self, a: TransformerArgs, device=None) -> None:
        super().__init__()
        self.a = a
        self.router = nn.Linear(a.dim, a.moe_experts, bias=False, device=device)
        self.experts = nn.ModuleList(
            SwiGLU(a.dim, a.ffn_dim, device=device) for _ in range(a.moe_experts)
        )
        self.aux_loss: torch.Tensor | None = None
        """The last forward's load-balancing loss, until the model's forward consumes it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.a
        probs = F.softmax(self.router(x).float(), dim=-1)
        weights, chosen = probs.topk(a.moe_top_k, dim=-1)
        weights = (weights / weights.sum(-1, keepdim=True)).type_as(x)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            tok, slot = (chosen == e).nonzero(as_tuple=True)
            if tok.numel():
                y = expert(x[tok]) * weights[tok, slot, None]
                out.index_add_(0, tok, y)
        frac = F.one_hot(chosen, a.moe_experts).float().sum((0, 1)) / chosen.numel()
        self.aux_loss = a.moe_experts * (frac * probs.mean(0)).sum()
        return out


class Block(nn.Module):
    def __init__(self, a: TransformerArgs, device=None) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(a.dim, a.norm_eps, device=device)
        self.attn = Attention(a, device=device)
        self.ffn_norm = RMSNorm(a.dim, a.norm_eps, device=device)
        self.ffn = MoE(a, device=device) if a.moe_experts else SwiGLU(a.dim, a.ffn_dim, device)

    def forward(self, x: torch.Tensor, rot: Rotary, mask: torch.Tensor | Documents) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), rot, mask)
        return x + self.ffn(self.ffn_norm(x))


class Transformer(nn.Module):
    """Decoder-only LM over one packed micro-batch; `forward` returns the mean token loss.

    With `tie_embeddings` the head's weight is the embedding's (one parameter, two names).
    """

    def __init__(self, a: TransformerArgs, device=None) -> None:
        super().__init__()
        self.args = a
        self.embed = nn.Embedding(a.vocab_size, a.dim, device=device)
        self.layers = nn.ModuleList(Block(a, device=device) for _ in range(a.n_layers))
        self.norm = RMSNorm(a.dim, a.norm_eps, device=device)
        self.head = nn.Linear(a.dim, a.vocab_size, bias=False, device=device)
        if a.tie_embeddings:
            self.head.weight = self.embed.weight
        self.dense_attention = False
        """Force the dense reference path where the documents path would run (tests)."""
        self.attention_kernel = "varlen"
        """The documents path's kernel, one of `unbroken.model.attention.KERNELS`."""

    def forward(
        self,
        tokens: torch.Tensor,
        targets: torch.Tensor,
        segment_ids: torch.Tensor,
        positions: torch.Tensor,
        doc_lengths: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Mean token loss of one packed micro-batch.

        Args:
            doc_lengths: the micro-batch's document lengths (`MicroBatch.doc_lengths`), which
                the documents path uses without reading `segment_ids` back from the device;
                without them it derives the documents from `segment_ids`.
        """
        t = tokens.shape[0]
        mask: torch.Tensor | Documents
        if not self.dense_attention and uses_documents(tokens.device):
            mask = Documents.of(doc_lengths, segment_ids, self.attention_kernel)
        else:
            causal = torch.ones(t, t, dtype=torch.bool, device=tokens.device).tril()
            mask = causal & (segment_ids[:, None] == segment_ids[None, :])
        x = self.embed(tokens)
        rot = rotary(positions, self.args.head_dim, self.args.rope_theta)
        for layer in self.layers:
            x = layer(x, rot, mask)
        logits = self.head(self.norm(x)).float()
        loss = F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")
        loss = loss / (targets != IGNORE_INDEX).sum().clamp(min=1)
        if self.args.moe_experts:
            aux = sum(layer.ffn.aux_loss for layer in self.layers)
            for layer in self.layers:  # consumed: nothing of a forward outlives its backward
                layer.ffn.aux_loss = None  # (on a GPU it would sit in lent memory)
            loss = loss + self.args.moe_aux_coef * aux / self.args.n_layers
        return loss


def build_model(args: TransformerArgs, device: str | torch.device = "meta") -> Transformer:
    """Build the reference model; on "meta" it holds no storage until materialized (and its
    initializers are skipped: `unbroken.model.meta`)."""
    device = torch.device(device)
    if device.type != "meta":
        return Transformer(args, device=device)
    with skip_meta_init():
        return Transformer(args, device=device)


def compile_blocks(model: Transformer, cuda_graphs: bool = False) -> Transformer:
    """Compile every block with `torch.compile` (norms, RoPE, SwiGLU and residuals fused around
    the matrix products), for the "flex" attention kernel, which the block graphs include.

    The blocks share their compiled graphs (their modules are graph inputs); other document
    counts and lengths reuse them. The "varlen" kernel breaks the graphs around its call and
    recompiles as document counts change: use "flex" with compiled blocks. Worth it on a GPU
    only: the CPU reference keeps its eager bits. With `cuda_graphs` each block's forward and
    backward replay as CUDA graphs (Inductor's "reduce-overhead" mode): the host then launches
    one graph per block instead of every kernel and matrix product in it, and the step stops
    depending on the host's speed (on the H200 machines a block's ~20 cuBLAS calls cost the
    host as long as the device spends on them). Returns `model`.
    """
    mode = "reduce-overhead" if cuda_graphs else None
    for layer in model.layers:
        layer.compile(dynamic=False, mode=mode)
    return model
