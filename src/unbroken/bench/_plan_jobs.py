"""The jobs `unbroken bench plan` runs: ResiHP §8's models on Table 3's parallel settings.

Owns the model descriptions (public configurations of LLaMA 2 and Qwen 2.5; the "30B" LLaMA is
LLaMA 1's 33B, as LLaMA 2 has no 30B), the job layouts (Megatron's rank order: TP innermost,
then DP, then PP, so one 8-GPU node holds one stage of both replicas and every stage boundary
crosses nodes), and the healthy cluster state of each job.
"""

from __future__ import annotations

from dataclasses import dataclass

from unbroken.parallel import Replica, StageGroup, split_layers
from unbroken.plan import ClusterState, Fabric, Layout, Workload
from unbroken.sim.hardware import HardwareConfig
from unbroken.sim.workload import ModelConfig

__all__ = ["JOBS", "SCALE_JOBS", "JobSpec", "initial_layout", "initial_state"]

SEQ = 4096
"""Tokens per micro-batch (one sequence at LLaMA 2's context; Table 3 gives no batch size)."""


def _model(name: str, params: float, layers: int, hidden: int, vocab: int, heads: int):
    return ModelConfig(
        name=name,
        total_params=params,
        active_params=params,
        layers=layers,
        hidden=hidden,
        vocab=vocab,
        attn_dim=2 * heads * (hidden // heads),
        seq_len=SEQ,
    )


MODELS = {
    # LLaMA 2 (Touvron et al. 2023, Table 1 / public configs): 7B, 13B; LLaMA 1 33B as "30B".
    "llama2-7b": _model("llama2-7b", 6.74e9, 32, 4096, 32000, 32),
    "llama2-13b": _model("llama2-13b", 13.0e9, 40, 5120, 32000, 40),
    "llama-30b": _model("llama-30b", 32.5e9, 60, 6656, 32000, 52),
    "llama2-70b": _model("llama2-70b", 69.0e9, 80, 8192, 32000, 64),
    # Qwen 2.5 (public configs): query heads set the attention FLOPs (GQA shares K/V only).
    "qwen2.5-7b": _model("qwen2.5-7b", 7.62e9, 28, 3584, 152064, 28),
    "qwen2.5-14b": _model("qwen2.5-14b", 14.7e9, 48, 5120, 152064, 40),
    "qwen2.5-32b": _model("qwen2.5-32b", 32.8e9, 64, 5120, 152064, 40),
}


@dataclass(frozen=True, slots=True)
class JobSpec:
    """One training job of the bench."""

    model: str
    tp: int
    dp: int
    pp: int
    microbatches: int
    """Micro-batches per replica per iteration."""
    hours: float
    """Length of the fail-stop session (Table 6: 4-16 h, scaled by model size)."""

    @property
    def gpus(self) -> int:
        return self.tp * self.dp * self.pp

    @property
    def batch(self) -> int:
        """Sequences per iteration (samples)."""
        return self.dp * self.microbatches


# Table 3: Small (4, 2, 2), Medium (4, 2, 4), Large (4, 2, 8), XLarge (4, 4, 16) as (TP, DP, PP).
# Sessions of 4, 8 and 16 hours leave 50 % of the GPUs at one kill every 30 minutes (§8.3).
JOBS = {
    "llama2-7b": JobSpec("llama2-7b", 4, 2, 2, 32, 4.0),
    "llama2-13b": JobSpec("llama2-13b", 4, 2, 4, 32, 8.0),
    "llama-30b": JobSpec("llama-30b", 4, 2, 8, 32, 16.0),
    "qwen2.5-7b": JobSpec("qwen2.5-7b", 4, 2, 2, 32, 4.0),
    "qwen2.5-14b": JobSpec("qwen2.5-14b", 4, 2, 4, 32, 8.0),
    "qwen2.5-32b": JobSpec("qwen2.5-32b", 4, 2, 8, 32, 16.0),
}
SCALE_JOBS = {
    256: JobSpec("llama2-70b", 4, 4, 16, 32, 16.0),
    4096: JobSpec("llama2-70b", 4, 64, 16, 32, 16.0),
}
"""Planning-time jobs: Table 3's XLarge layout on 256 GPUs, and its DP grown to 4,096 GPUs."""


def initial_layout(spec: JobSpec) -> Layout:
    """The job's plan: even layer split, rank = (s * dp + d) * tp + i (Megatron's order)."""
    model = MODELS[spec.model]
    split = split_layers(model.layers, spec.pp)
    edges = [sum(split[:k]) for k in range(spec.pp + 1)]
    replicas = tuple(
        Replica(
            tuple(
                StageGroup(
                    tuple((s * spec.dp + d) * spec.tp + i for i in range(spec.tp)),
                    (edges[s], edges[s + 1]),
                )
                for s in range(spec.pp)
            )
        )
        for d in range(spec.dp)
    )
    return Layout(replicas=replicas, microbatches=(spec.microbatches,) * spec.dp)


def initial_state(spec: JobSpec, hw: HardwareConfig, memory_bytes: float) -> ClusterState:
    """Every GPU of the job healthy, 8 (the preset's count) per node."""
    workload = Workload.from_model(MODELS[spec.model], hw)
    layout = initial_layout(spec)
    return ClusterState.healthy(
        layout.skeleton, workload, Fabric.from_hardware(hw), memory_bytes=memory_bytes
    )
