"""Pipeline stages of a Hugging Face causal LM: the part of an `HFCausalLM` one rank would hold.

A decoder-only `transformers` model whose base model is `embed_tokens -> layers -> norm` with a
`rotary_emb` (what its config's `base_model_pp_plan` declares: Llama, Qwen2, Mistral, ...) splits
at decoder-layer boundaries the way the reference model does: `HFStageModel` holds the embedding
when it runs layer 0, its decoder layers, and the final norm, head and loss when it runs the last
layer. It has the interface `unbroken.engine.interpreter.PlanWorker` drives
(`forward(layers, x, inputs)`, `args.dim`, `wgrad`, `tied`, `layer_ranges`), takes its modules
from a full model (built on "meta" for the engine, then materialized into flat storage), and
keeps the full model's parameter names, so a full model's state maps onto any stage by name.
Each stage builds the attention mask and rotary embeddings from the micro-batch's positions
itself, exactly as the full model does, so a chain of stages computes the full model's loss and
gradients (tests/ecosystem/test_hf_models.py).

The plan engine builds it through the factory's stage source (`unbroken.integrations.hf.HFPipeline`,
the `pipeline` attribute of `hf_causal_lm`; the protocol is `unbroken.engine.own_stages`).

What it does not do: tensor parallelism (HF layers are plain `nn.Linear`; TP degree 1 only) and
the zero-bubble split of weight gradients (no `SplitLinear`: a split backward computes all of a
stage's gradients in B and its W has nothing left to do, correct but without the saving).

The loss (`token_cross_entropy`) lives here, below `unbroken.integrations.hf`, which uses it
too and imports this module (so the factory can name its stage source without an import cycle).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from unbroken.data.packing import IGNORE_INDEX
from unbroken.engine.wgrad import WeightGradSink

__all__ = [
    "EMBED",
    "HEAD",
    "HFStageModel",
    "StageArgs",
    "check_pipelinable",
    "check_pipeline_plan",
    "token_cross_entropy",
]

_PARTS = ("embed_tokens", "layers", "norm")
"""The base model's pipeline plan (`base_model_pp_plan`) a stage split needs."""

EMBED, HEAD = "hf.model.embed_tokens.weight", "hf.lm_head.weight"


@dataclass(frozen=True, slots=True)
class StageArgs:
    """The full model's sizes a plan worker reads (`model.args`)."""

    dim: int
    n_layers: int


def token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of `logits` [T, V] against next-token `targets` [T] (IGNORE_INDEX
    where a position predicts nothing), computed in fp32 as the reference model computes it."""
    loss = F.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX, reduction="sum")
    return loss / (targets != IGNORE_INDEX).sum().clamp(min=1)


def check_pipeline_plan(config) -> None:
    """Raise ValueError when a `transformers` config declares no `embed_tokens -> layers ->
    norm` pipeline plan (checked from the config alone, before any model is built)."""
    plan = tuple(getattr(config, "base_model_pp_plan", None) or ())
    if plan != _PARTS:
        raise ValueError(
            f"model_type {config.model_type!r} does not split into pipeline stages "
            f"(its base model's pipeline plan is {list(plan)}, not {list(_PARTS)} with rotary "
            "embeddings)"
        )


def check_pipelinable(full: nn.Module) -> None:
    """Raise ValueError when `full` (an `HFCausalLM`) does not split into decoder-layer
    stages."""
    hf = full.hf
    check_pipeline_plan(hf.config)
    if not hasattr(hf.model, "rotary_emb") or not hasattr(hf, "lm_head"):
        raise ValueError(
            f"model_type {hf.config.model_type!r} does not split into pipeline stages "
            f"(no rotary embeddings or no lm_head)"
        )


class HFStageModel(nn.Module):
    """The decoder layers one rank holds of an `HFCausalLM`, with the embedding on the rank
    running layer 0 and the norm, head and loss on the rank running the last layer.

    Args:
        full: the full `HFCausalLM`; the stage takes its modules (their storage is replaced
            by the engine's flat storage), so build one full model per stage model.
        layer_ranges: the half-open layer range of every virtual stage this rank runs.

    Raises:
        ValueError: a model that does not split (`check_pipelinable`) or a range outside it.
    """

    def __init__(self, full: nn.Module, layer_ranges: Sequence[tuple[int, int]]) -> None:
        super().__init__()
        check_pipelinable(full)
        hf = full.hf
        n = hf.config.num_hidden_layers
        self.config = hf.config
        self.args = StageArgs(dim=hf.config.hidden_size, n_layers=n)
        self.wgrad = WeightGradSink()
        self.layer_ranges = tuple((int(lo), int(hi)) for lo, hi in layer_ranges)
        for lo, hi in self.layer_ranges:
            if not 0 <= lo < hi <= n:
                raise ValueError(f"layer range {(lo, hi)} outside [0, {n})")
        tied = hf.lm_head.weight is hf.model.embed_tokens.weight
        self.tied = ((EMBED, HEAD),) if tied else ()
        """Groups of names that are one parameter of the full model (`FlatLayout.of`)."""
        owned = sorted(i for lo, hi in self.layer_ranges for i in range(lo, hi))
        self.hf = nn.Module()
        self.hf.model = body = nn.Module()
        body.rotary_emb = hf.model.rotary_emb
        if any(lo == 0 for lo, _ in self.layer_ranges):
            body.embed_tokens = hf.model.embed_tokens
        body.layers = nn.ModuleDict({str(i): hf.model.layers[i] for i in owned})
        if any(hi == n for _, hi in self.layer_ranges):
            body.norm = hf.model.norm
            self.hf.lm_head = hf.lm_head

    def _masks(self, h: torch.Tensor, position_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        from transformers.masking_utils import (
            create_causal_mask,
            create_sliding_window_causal_mask,
        )

        masks = {"full_attention": create_causal_mask(self.config, h, None, None, position_ids)}
        if "sliding_attention" in (getattr(self.config, "layer_types", None) or ()):
            masks["sliding_attention"] = create_sliding_window_causal_mask(
                self.config, h, None, None, position_ids
            )
        return masks

    def _layer_type(self, i: int) -> str:
        types = getattr(self.config, "layer_types", None)
        return types[i] if types else "full_attention"

    def forward(self, layers: tuple[int, int], x: torch.Tensor | None, inputs) -> torch.Tensor:
        """Run one virtual stage on one micro-batch.

        Args:
            layers: the stage's layer range (one of `layer_ranges`).
            x: the activation [T, dim] from the previous stage; None for the stage holding
                layer 0.
            inputs: the micro-batch's tokens, targets and positions
                (`unbroken.engine.stage.MicroBatchInputs`).

        Returns:
            The output activation [T, dim], or the micro-batch's mean loss for the last stage.
        """
        lo, hi = layers
        body = self.hf.model
        position_ids = inputs.positions.unsqueeze(0)
        h = body.embed_tokens(inputs.tokens.unsqueeze(0)) if lo == 0 else x.unsqueeze(0)
        masks = self._masks(h, position_ids)
        rope = body.rotary_emb(h, position_ids)
        for i in range(lo, hi):
            h = body.layers[str(i)](
                h,
                attention_mask=masks[self._layer_type(i)],
                position_ids=position_ids,
                position_embeddings=rope,
            )
        if hi < self.args.n_layers:
            return h[0]
        logits = self.hf.lm_head(body.norm(h))[0]
        return token_cross_entropy(logits, inputs.targets)
