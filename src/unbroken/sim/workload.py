"""Model and parallelism descriptions, and the per-GPU quantities derived from them.

Owns `ModelConfig` (what is trained), `ParallelConfig` (how it is laid out: DP/TP/PP/EP,
microbatching, optimizer sharding) and `Placement`, the derived per-GPU parameter counts, FLOPs
and byte sizes that the iteration-time, checkpoint and RMU models consume. MoE expert sizes are
derived from the published total/active parameter counts (Leto Tables 2 and 5), so a preset
needs no per-layer architecture trivia beyond layers, hidden size, vocabulary and attention width.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from unbroken.errors import UserError
from unbroken.sim._load import check_positive

__all__ = ["ModelConfig", "ParallelConfig", "Placement", "place"]

# Bytes per parameter under BF16 mixed precision with Adam (Leto App. A.1): BF16 weights,
# FP32 main gradients (Megatron accumulates and reduces gradients in FP32), FP32 master copy,
# FP32 first and second moments.
PARAM_BYTES = 2
GRAD_BYTES = 4
OPTIM_BYTES = 12


@dataclass(kw_only=True, slots=True, frozen=True)
class ModelConfig:
    """A dense or MoE transformer, described by its published sizes."""

    name: str
    """Label printed in reports and used by `--model`."""
    total_params: float
    """All parameters, embeddings included (paper Tables 2/5)."""
    active_params: float
    """Parameters used per token (= total for dense models)."""
    layers: int
    """Transformer layers."""
    hidden: int
    """Model width d."""
    vocab: int
    """Vocabulary size; the input embedding and output head are vocab x hidden each."""
    tied_embeddings: bool = False
    """True when the input embedding and output head share weights."""
    attn_dim: int
    """Sum over attention heads of (query/key dim + value dim); the score and value matmuls cost
    seq * attn_dim FLOPs per token per layer in the forward pass (causal)."""
    experts: int = 0
    """Routed experts per MoE layer; 0 for a dense model."""
    top_k: int = 0
    """Routed experts per token."""
    moe_layers: int = 0
    """Layers whose FFN is an MoE block."""
    seq_len: int
    """Training sequence length."""

    def __post_init__(self) -> None:
        check_positive(self, "total_params", "active_params", "layers", "hidden", "vocab")
        check_positive(self, "attn_dim", "seq_len")
        if self.active_params > self.total_params:
            raise UserError("active_params must not exceed total_params")
        if self.experts:
            if not 0 < self.top_k < self.experts:
                raise UserError(f"top_k must be in (0, experts={self.experts}), got {self.top_k}")
            if not 0 < self.moe_layers <= self.layers:
                raise UserError(f"moe_layers must be in (0, layers={self.layers}]")
        elif self.total_params != self.active_params:
            raise UserError("a dense model (experts = 0) needs total_params == active_params")

    @property
    def is_moe(self) -> bool:
        """True for a mixture-of-experts model."""
        return self.experts > 0

    @property
    def embedding_params(self) -> float:
        """Input embedding plus output head parameters."""
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2)

    @property
    def expert_params(self) -> float:
        """All routed-expert parameters. From total = dense + E*e and active = dense + k*e per
        MoE layer: e = (total - active) / ((E - k) * moe_layers)."""
        if not self.is_moe:
            return 0.0
        per_expert = (self.total_params - self.active_params) / (
            (self.experts - self.top_k) * self.moe_layers
        )
        return per_expert * self.experts * self.moe_layers

    @property
    def dense_body_params(self) -> float:
        """Non-expert, non-embedding parameters (attention, norms, shared experts, dense FFNs)."""
        return self.total_params - self.expert_params - self.embedding_params

    def forward_flops_per_token_per_layer(self) -> float:
        """Forward FLOPs of one transformer layer for one token, averaged over layers:
        2 * active body parameters / layers + causal attention seq * attn_dim."""
        active_body = self.active_params - self.embedding_params
        return 2.0 * active_body / self.layers + self.seq_len * self.attn_dim


@dataclass(kw_only=True, slots=True, frozen=True)
class ParallelConfig:
    """How a model is laid out on GPUs and batched (Megatron-style 4D parallelism)."""

    dp: int
    """Data-parallel degree."""
    tp: int
    """Tensor-parallel degree (with sequence parallelism)."""
    pp: int
    """Pipeline-parallel degree S."""
    ep: int = 1
    """Expert-parallel degree, carved out of dp * tp (expert tensor parallelism 1)."""
    vpp: int = 1
    """Virtual-pipeline (interleaving) degree v: model chunks per pipeline rank."""
    micro_batch: int = 1
    """Sequences per microbatch."""
    global_batch: int
    """Sequences per iteration across all DP replicas."""
    sharded_optimizer: bool = True
    """Optimizer states sharded across DP ranks (distributed optimizer / ZeRO-1)."""
    activation_recompute: bool = True
    """Full activation checkpointing at each layer input (Leto App. A.1): one extra forward."""
    overlap_grad_reduce: bool = True
    """Overlap DP gradient collectives with backward (Megatron `--overlap-grad-reduce`)."""

    def __post_init__(self) -> None:
        check_positive(self, "dp", "tp", "pp", "ep", "vpp", "micro_batch", "global_batch")
        if (self.dp * self.tp) % self.ep:
            raise UserError(f"ep={self.ep} must divide dp*tp={self.dp * self.tp}")
        if self.global_batch % (self.dp * self.micro_batch):
            raise UserError(
                f"global_batch={self.global_batch} must be a multiple of "
                f"dp*micro_batch={self.dp * self.micro_batch}"
            )

    @property
    def world(self) -> int:
        """GPUs in the job: dp * tp * pp."""
        return self.dp * self.tp * self.pp

    @property
    def microbatches(self) -> int:
        """M: microbatches per pipeline per iteration."""
        return self.global_batch // (self.dp * self.micro_batch)

    @property
    def expert_dp(self) -> int:
        """Data-parallel degree of expert parameters: dp * tp / ep."""
        return self.dp * self.tp // self.ep


@dataclass(kw_only=True, slots=True, frozen=True)
class Placement:
    """Per-GPU quantities of one (model, parallelism) pair, for the busiest (last) stage."""

    layers_per_stage: int
    """Layers on the busiest pipeline stage (ceil(layers / pp))."""
    tokens_per_microbatch: int
    """micro_batch * seq_len."""
    dense_params_per_gpu: float
    """Non-expert parameters held by one GPU of the last stage (incl. its output head)."""
    expert_params_per_gpu: float
    """Routed-expert parameters held by one GPU of the last stage."""
    model_state_bytes: float
    """Retained model state per GPU: BF16 weights + this GPU's optimizer shard (Leto §2.2)."""
    grad_bytes: float
    """FP32 main-gradient buffer per GPU."""
    ckpt_bytes: float
    """Bytes one GPU writes per checkpoint (weights and optimizer states, deduplicated across
    DP replicas when the optimizer is sharded, as Megatron distributed checkpoints do)."""


def place(model: ModelConfig, par: ParallelConfig) -> Placement:
    """Derive the per-GPU quantities of `model` laid out by `par`.

    Raises:
        UserError: when the layout does not fit the model (more stages than layers, experts not
            divisible by ep).
    """
    if par.pp > model.layers:
        raise UserError(f"pp={par.pp} exceeds the model's {model.layers} layers")
    if model.is_moe and model.experts % par.ep:
        raise UserError(f"ep={par.ep} must divide experts={model.experts}")
    if not model.is_moe and par.ep != 1:
        raise UserError("a dense model needs ep = 1")
    layers_per_stage = math.ceil(model.layers / par.pp)
    stage_share = layers_per_stage / model.layers
    head = model.vocab * model.hidden / par.tp
    dense = model.dense_body_params * stage_share / par.tp + head
    expert = model.expert_params * stage_share / par.ep
    dense_shard = par.dp if par.sharded_optimizer else 1
    expert_shard = par.expert_dp if par.sharded_optimizer else 1
    optim = OPTIM_BYTES * (dense / dense_shard + expert / expert_shard)
    weights = PARAM_BYTES * (dense + expert)
    ckpt_weights = PARAM_BYTES * (dense / dense_shard + expert / expert_shard)
    return Placement(
        layers_per_stage=layers_per_stage,
        tokens_per_microbatch=par.micro_batch * model.seq_len,
        dense_params_per_gpu=dense,
        expert_params_per_gpu=expert,
        model_state_bytes=weights + optim,
        grad_bytes=GRAD_BYTES * (dense + expert),
        ckpt_bytes=ckpt_weights + optim,
    )
