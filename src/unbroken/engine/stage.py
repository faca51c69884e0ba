"""The part of the reference Llama model one rank holds: its layer ranges, TP-sharded.

`StageModel` holds, for one rank, the layers of every virtual stage the rank runs (one range,
or v ranges under interleaving), the vocabulary-parallel embedding when it runs layer 0 and
the final norm and vocabulary-parallel head when it runs the last layer. Parameter names are
those of `unbroken.model.llama.Transformer` (``layers.3.attn.wq.weight``), so a full model's
state maps onto any rank's shard by name (`unbroken.engine.sharding`).

Sharding (Megatron): wq/wk/wv and w1/w3 are column-parallel (output rows split: whole query
heads, whole kv-groups, ffn columns), wo and w2 are row-parallel (input columns split, output
all-reduced), embedding and head split by vocabulary, norms replicated. Grouped-query attention
keeps its grouping: position r holds query heads [r·H/t, (r+1)·H/t) and kv-groups
[r·G/t, (r+1)·G/t), which are exactly the groups those query heads read. As in Megatron, the
kv-group count must be divisible by the TP degree.

Tied embedding and head (`TransformerArgs.tie_embeddings`): a rank that runs both the first and
the last layer holds one parameter under both names; otherwise the first stage holds the
embedding and the last stage a copy named ``head.weight`` (both sharded by vocabulary alike),
and `unbroken.engine.tied` sums their gradients ([Note: shared parameters] in
`unbroken.model.flat`; `tied` is the argument `FlatLayout.of` needs for it).

Like the reference model it owns no storage: build it on "meta", then
`unbroken.model.flat.materialize` puts its parameters into the caller's flat buffer
([Note: flat-storage]). See [Note: tp-degree-1] in `unbroken.engine.tp` for TP degree 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from unbroken.engine.emulate import (
    cols,
    emulated_cross_entropy,
    emulated_embedding,
    fold,
    fork,
    rows,
)
from unbroken.engine.tp import (
    TPGroup,
    copy_to_tp,
    reduce_from_tp,
    token_mean,
    vocab_parallel_cross_entropy,
    vocab_parallel_embedding,
)
from unbroken.engine.wgrad import SplitLinear, WeightGradSink
from unbroken.model.llama import RMSNorm, TransformerArgs, rope

__all__ = ["MicroBatchInputs", "StageModel", "check_tp_degree"]


def check_tp_degree(args: TransformerArgs, tp: int) -> None:
    """Raise ValueError naming the first model size the TP degree does not divide."""
    if args.moe_experts:
        raise ValueError("the engine runs the dense model only (moe_experts must be 0)")
    for what, n in (
        ("n_heads", args.n_heads),
        ("n_kv_heads", args.n_kv_heads),
        ("ffn_dim", args.ffn_dim),
        ("vocab_size", args.vocab_size),
    ):
        if n % tp:
            raise ValueError(f"model {what}={n} is not divisible by the TP degree {tp}")


@dataclass(slots=True)
class MicroBatchInputs:
    """What every stage needs from a micro-batch besides its activation (read from the data
    source on each rank: the source is a pure function of (iteration, shard))."""

    tokens: torch.Tensor
    targets: torch.Tensor
    positions: torch.Tensor
    mask: torch.Tensor
    """Block-diagonal causal mask [T, T], as the reference model builds it."""

    @classmethod
    def of(cls, mb, device: torch.device) -> MicroBatchInputs:
        tokens, targets, segment_ids, positions = (
            t.to(device, non_blocking=True)
            for t in (mb.tokens, mb.targets, mb.segment_ids, mb.positions)
        )
        t = tokens.shape[0]
        causal = torch.ones(t, t, dtype=torch.bool, device=device).tril()
        mask = causal & (segment_ids[:, None] == segment_ids[None, :])
        return cls(tokens, targets, positions, mask)


class _Attention(nn.Module):
    def __init__(
        self, a: TransformerArgs, tp: TPGroup, sink: WeightGradSink, emulate: int, device=None
    ) -> None:
        super().__init__()
        self.a, self.tp, self.emulate = a, tp, emulate
        self.n_heads = a.n_heads // tp.size
        self.n_kv_heads = a.n_kv_heads // tp.size
        hd = a.head_dim
        self.wq = SplitLinear(a.dim, self.n_heads * hd, sink, device=device)
        self.wk = SplitLinear(a.dim, self.n_kv_heads * hd, sink, device=device)
        self.wv = SplitLinear(a.dim, self.n_kv_heads * hd, sink, device=device)
        self.wo = SplitLinear(self.n_heads * hd, a.dim, sink, device=device)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        e = self.emulate
        if e == 1:
            w = (self.wq.weight, self.wk.weight, self.wv.weight, self.wo.weight)
            part = self._heads(copy_to_tp(x, self.tp), positions, mask, w, 1)
            return reduce_from_tp(part, self.tp)
        parts = []
        for i in range(e):
            qkv = (rows(m.weight, i, e) for m in (self.wq, self.wk, self.wv))
            w = (*qkv, cols(self.wo.weight, i, e))
            parts.append(self._heads(fork(x), positions, mask, w, e))
        return fold(parts)

    def _heads(self, x, positions, mask, w: tuple[torch.Tensor, ...], e: int) -> torch.Tensor:
        """One TP position's attention output before the group's sum: its heads through
        weights `w` (wq, wk, wv, wo shards); `e` positions share this rank's heads."""
        a, t = self.a, x.shape[0]
        n_heads, n_kv_heads = self.n_heads // e, self.n_kv_heads // e
        q = rope(self.wq.with_weight(x, w[0]).view(t, n_heads, a.head_dim), positions, a.rope_theta)
        k = self.wk.with_weight(x, w[1]).view(t, n_kv_heads, a.head_dim)
        k = rope(k, positions, a.rope_theta)
        v = self.wv.with_weight(x, w[2]).view(t, n_kv_heads, a.head_dim)
        rep = n_heads // n_kv_heads
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        q, k, v = (y.transpose(0, 1).float() for y in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.wo.with_weight(out.transpose(0, 1).reshape(t, -1).type_as(x), w[3])


class _SwiGLU(nn.Module):
    def __init__(
        self, a: TransformerArgs, tp: TPGroup, sink: WeightGradSink, emulate: int, device=None
    ) -> None:
        super().__init__()
        self.tp, self.emulate = tp, emulate
        hidden = a.ffn_dim // tp.size
        self.w1 = SplitLinear(a.dim, hidden, sink, device=device)
        self.w3 = SplitLinear(a.dim, hidden, sink, device=device)
        self.w2 = SplitLinear(hidden, a.dim, sink, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = self.emulate
        if e == 1:
            x = copy_to_tp(x, self.tp)
            return reduce_from_tp(self.w2(F.silu(self.w1(x)) * self.w3(x)), self.tp)
        parts = []
        for i in range(e):
            xi = fork(x)
            h = F.silu(self.w1.with_weight(xi, rows(self.w1.weight, i, e)))
            h = h * self.w3.with_weight(xi, rows(self.w3.weight, i, e))
            parts.append(self.w2.with_weight(h, cols(self.w2.weight, i, e)))
        return fold(parts)


class _Block(nn.Module):
    def __init__(
        self, a: TransformerArgs, tp: TPGroup, sink: WeightGradSink, emulate: int, device=None
    ) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(a.dim, a.norm_eps, device=device)
        self.attn = _Attention(a, tp, sink, emulate, device=device)
        self.ffn_norm = RMSNorm(a.dim, a.norm_eps, device=device)
        self.ffn = _SwiGLU(a, tp, sink, emulate, device=device)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), positions, mask)
        return x + self.ffn(self.ffn_norm(x))


class StageModel(nn.Module):
    """The layers one rank holds, sharded over its stage's TP group.

    Args:
        args: the full model's sizes.
        layer_ranges: the half-open layer range of every virtual stage this rank runs.
        tp: this rank's TP position and group (the same for all its virtual stages).
        device: "meta" to build without storage (then `materialize` into flat buffers).
        emulate: at TP 1, the TP degree the stage computes as (`unbroken.engine.emulate`: the
            bits of the group it replaces); 1 computes the reference model's.

    Raises:
        ValueError: a model size the TP degree (or `emulate`) does not divide, emulation
            above TP 1, or a range outside the model.
    """

    def __init__(
        self,
        args: TransformerArgs,
        layer_ranges: Sequence[tuple[int, int]],
        tp: TPGroup,
        device: str | torch.device = "meta",
        emulate: int = 1,
    ) -> None:
        super().__init__()
        check_tp_degree(args, tp.size)
        if emulate > 1 and tp.size > 1:
            raise ValueError(f"a TP-{tp.size} stage cannot compute as TP {emulate}")
        check_tp_degree(args, emulate)
        self.emulate = emulate
        device = torch.device(device)
        self.args, self.tp = args, tp
        self.wgrad = WeightGradSink()
        """Open during a split B: linear weight gradients wait there for W ([Note: split
        backward] in `unbroken.engine.wgrad`)."""
        self.layer_ranges = tuple((int(lo), int(hi)) for lo, hi in layer_ranges)
        for lo, hi in self.layer_ranges:
            if not 0 <= lo < hi <= args.n_layers:
                raise ValueError(f"layer range {(lo, hi)} outside [0, {args.n_layers})")
        self.tied = args.tied
        """Groups of names that are one parameter of the full model (`FlatLayout.of`)."""
        owned = sorted(i for lo, hi in self.layer_ranges for i in range(lo, hi))
        if any(lo == 0 for lo, _ in self.layer_ranges):
            v_local = args.vocab_size // tp.size
            self.embed = nn.Embedding(v_local, args.dim, device=device)
        self.layers = nn.ModuleDict(
            {str(i): _Block(args, tp, self.wgrad, emulate, device=device) for i in owned}
        )
        if any(hi == args.n_layers for _, hi in self.layer_ranges):
            self.norm = RMSNorm(args.dim, args.norm_eps, device=device)
            v_local = args.vocab_size // tp.size
            self.head = SplitLinear(args.dim, v_local, self.wgrad, device=device)
            if args.tie_embeddings and hasattr(self, "embed"):
                self.head.weight = self.embed.weight

    def forward(
        self, layers: tuple[int, int], x: torch.Tensor | None, inputs: MicroBatchInputs
    ) -> torch.Tensor:
        """Run one virtual stage on one micro-batch.

        Args:
            layers: the stage's layer range (one of `layer_ranges`).
            x: the activation from the previous stage; None for the stage holding layer 0.
            inputs: the micro-batch's tokens, targets, positions and mask.

        Returns:
            The output activation [T, dim], or the micro-batch's mean loss for the last stage.
        """
        lo, hi, e = *layers, self.emulate
        if lo == 0 and e > 1:
            x = emulated_embedding(inputs.tokens, self.embed.weight, e)
        elif lo == 0:
            x = vocab_parallel_embedding(inputs.tokens, self.embed.weight, self.tp)
        for i in range(lo, hi):
            x = self.layers[str(i)](x, inputs.positions, inputs.mask)
        if hi < self.args.n_layers:
            return x
        if e > 1:
            h = self.norm(x)
            shards = [
                self.head.with_weight(fork(h), rows(self.head.weight, i, e)).float()
                for i in range(e)
            ]
            return token_mean(emulated_cross_entropy(shards, inputs.targets), inputs.targets)
        logits = self.head(copy_to_tp(self.norm(x), self.tp)).float()
        return vocab_parallel_cross_entropy(logits, inputs.targets, self.tp)
