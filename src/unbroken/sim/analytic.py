"""Per-stage timings from a hardware description instead of a profile (App. C.1, input (b)).

Owns the roofline-style estimates of a bracket (a stage's layers for one microbatch): GEMM time
from FLOPs at a fraction of peak, tensor-parallel collectives, MoE all-to-all, pipeline
point-to-point sends, gradient buckets and the optimizer step, plus the two byte-moving costs the
recovery policies add: a checkpoint save/load and RMU's per-iteration update overhead. It emits
`IterationInputs` and never applies the pipeline or queue formulas itself.

[Note: collective cost model] A ring reduce-scatter or all-gather of a B-byte buffer over n GPUs
costs (n-1)/n * B / bw + (n-1) * latency, an all-reduce twice that; bw is the NVLink bus bandwidth
when the group fits in one node and the per-GPU network share otherwise. An all-to-all moves
(n-1)/n of the per-GPU buffer, the part leaving the node at network bandwidth.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from unbroken.sim.hardware import HardwareConfig
from unbroken.sim.itertime import IterationInputs, megatron_bucket_params
from unbroken.sim.workload import (
    GRAD_BYTES,
    PARAM_BYTES,
    ModelConfig,
    ParallelConfig,
    Placement,
    place,
)

__all__ = [
    "RmuConfig",
    "analytic_inputs",
    "checkpoint_load_s",
    "checkpoint_save_s",
    "rmu_overhead_s",
]

ACT_BYTES = 2  # BF16 activations
# Optimizer step bytes per locally owned parameter: read FP32 grad, master, m, v (16 B);
# write master, m, v (12 B) and the BF16 weight (2 B).
STEP_BYTES = 30


@dataclass(kw_only=True, slots=True, frozen=True)
class RmuConfig:
    """Resilient Memory Pool / Resumable Model Updater geometry (Leto §4.1, §5.2)."""

    data_pages: int = 1024
    """D: data pages per protection group (Leto §4.1 default)."""
    parity_pages: int = 16
    """H1: first-tier parity pages per group, kept in host memory (Leto §4.1 default)."""

    def __post_init__(self) -> None:
        if self.data_pages < 1 or self.parity_pages < 1:
            from unbroken.errors import UserError

            raise UserError("data_pages and parity_pages must be >= 1")


def _ring(bytes_: float, n: int, bw: float, lat: float) -> float:
    """One ring reduce-scatter or all-gather; see [Note: collective cost model]."""
    if n <= 1:
        return 0.0
    return (n - 1) / n * bytes_ / bw + (n - 1) * lat


def _link(hw: HardwareConfig, span: int) -> tuple[float, float]:
    """(bandwidth, latency) of a group whose members span `span` consecutive GPU slots."""
    if span <= hw.gpus_per_node:
        return hw.intra_node_bytes_per_s, hw.intra_node_latency_s
    return hw.inter_node_bytes_per_s, hw.inter_node_latency_s


def _all_to_all(hw: HardwareConfig, bytes_per_gpu: float, n: int) -> float:
    if n <= 1:
        return 0.0
    local = min(n, hw.gpus_per_node)
    intra = bytes_per_gpu * (local - 1) / n / hw.intra_node_bytes_per_s
    inter = bytes_per_gpu * (n - local) / n / hw.inter_node_bytes_per_s
    lat = hw.intra_node_latency_s if n <= hw.gpus_per_node else hw.inter_node_latency_s
    return max(intra, inter) + lat


def _grad_buckets(
    hw: HardwareConfig, pl: Placement, par: ParallelConfig
) -> tuple[list[float], list[float]]:
    """(seconds, parameters) of each gradient bucket's reduction."""
    # Gradient buckets: dense grads over DP, expert grads over expert-DP, FP32, ring
    # reduce-scatter (sharded optimizer) or all-reduce (replicated).
    coll = 1 if par.sharded_optimizer else 2
    bucket = megatron_bucket_params(par.dp)
    dp_bw, dp_lat = _link(hw, par.tp * par.dp)
    edp_bw, edp_lat = _link(hw, par.tp * par.dp)
    buckets_s: list[float] = []
    buckets_p: list[float] = []
    for params, group, bw, lat in (
        (pl.expert_params_per_gpu, par.expert_dp, edp_bw, edp_lat),
        (pl.dense_params_per_gpu, par.dp, dp_bw, dp_lat),
    ):
        if params <= 0 or group <= 1:
            continue
        n = max(1, math.ceil(params / bucket))
        size = params / n
        w = coll * _ring(size * GRAD_BYTES, group, bw, lat) * hw.concurrency_penalty
        buckets_s += [w] * n
        buckets_p += [size] * n
    return buckets_s, buckets_p


def _update_terms(
    hw: HardwareConfig, pl: Placement, par: ParallelConfig
) -> tuple[float, float, float]:
    """(optimizer step, scalar all-reduce, sharded-weight all-gather) seconds of the update."""
    dp_bw, dp_lat = _link(hw, par.tp * par.dp)
    edp_bw, edp_lat = _link(hw, par.tp * par.dp)
    # Update: the optimizer step over the local shard (HBM-bound), a scalar all-reduce (grad
    # norm, found-inf) across the job, and with a sharded optimizer the BF16 weight all-gather.
    dense_shard = par.dp if par.sharded_optimizer else 1
    expert_shard = par.expert_dp if par.sharded_optimizer else 1
    shard_params = pl.dense_params_per_gpu / dense_shard + pl.expert_params_per_gpu / expert_shard
    step = shard_params * STEP_BYTES / (hw.hbm_bytes_per_s * hw.hbm_efficiency)
    scalar = 2 * math.log2(max(2, par.world)) * hw.inter_node_latency_s
    gather = 0.0
    if par.sharded_optimizer:
        gather = _ring(pl.dense_params_per_gpu * PARAM_BYTES, par.dp, dp_bw, dp_lat)
        gather += _ring(pl.expert_params_per_gpu * PARAM_BYTES, par.expert_dp, edp_bw, edp_lat)
    return step, scalar, gather


# Long: the per-stage compute and communication formulas in one place, each commented.
def analytic_inputs(
    hw: HardwareConfig, model: ModelConfig, par: ParallelConfig, *, rmu_extra_s: float = 0.0
) -> IterationInputs:
    """Build `IterationInputs` for `model` under `par` on `hw`.

    Args:
        hw: the GPU and fabric.
        model: the model.
        par: its parallel layout and batching.
        rmu_extra_s: extra update-phase time per iteration (RMU), added to T_update.

    Returns:
        The per-stage timings and sync/update terms of one iteration.
    """
    pl = place(model, par)
    tokens = pl.tokens_per_microbatch
    flops_rate = hw.peak_flops * hw.compute_efficiency
    passes_fwd = 1 + (1 if par.activation_recompute else 0)  # forward + recompute
    fwd_layer = tokens * model.forward_flops_per_token_per_layer() / par.tp / flops_rate

    # Tensor parallelism with sequence parallelism: per layer and forward, two all-gathers and
    # two reduce-scatters of the full activation (attention block and FFN block).
    act = tokens * model.hidden * ACT_BYTES
    tp_bw, tp_lat = _link(hw, par.tp)
    tp_fwd_layer = 4 * _ring(act, par.tp, tp_bw, tp_lat)

    # MoE dispatch + combine per MoE layer and forward; tokens are split over TP by SP.
    moe_share = model.moe_layers / model.layers if model.is_moe else 0.0
    a2a_bytes = tokens / par.tp * model.top_k * model.hidden * ACT_BYTES
    a2a_fwd_layer = 2 * _all_to_all(hw, a2a_bytes, par.ep) * moe_share if model.is_moe else 0.0

    layer_fwd = fwd_layer + tp_fwd_layer + a2a_fwd_layer
    layers = pl.layers_per_stage
    forward = passes_fwd * layers * layer_fwd  # forward, plus recompute during backward
    backward = layers * (2 * fwd_layer + 2 * tp_fwd_layer + 2 * a2a_fwd_layer)
    # Output head + loss on the last stage (not recomputed): 2*T*V*d/tp forward, twice that back.
    head = 3 * 2 * tokens * model.vocab * model.hidden / par.tp / flops_rate
    # Inter-stage sends: activations (SP-sharded) forward and their gradients backward, once per
    # model chunk. Pipeline neighbours are dp*tp ranks apart, so they cross nodes at scale.
    p2p_bw, p2p_lat = _link(hw, par.tp * par.dp * 2)
    p2p = 0.0
    if par.pp > 1:
        p2p = 2 * par.vpp * (act / par.tp / p2p_bw + p2p_lat)
    body = forward + backward + p2p
    stages = [body] * par.pp
    stages[-1] += head
    window = backward + (head * 2 / 3 if par.pp == 1 else 0.0)
    if par.activation_recompute:
        window += layers * layer_fwd  # the recompute forward runs inside backward

    buckets_s, buckets_p = _grad_buckets(hw, pl, par)
    step, scalar, gather = _update_terms(hw, pl, par)
    inter_node_a2a = model.is_moe and par.ep > hw.gpus_per_node
    a2a_backward = layers * 2 * a2a_fwd_layer if inter_node_a2a else 0.0
    return IterationInputs(
        microbatches=par.microbatches,
        vpp=par.vpp,
        stage_s=tuple(stages),
        backward_window_s=window,
        bucket_s=tuple(buckets_s),
        bucket_params=tuple(buckets_p),
        overlap=par.overlap_grad_reduce,
        moe_a2a_s=a2a_backward,
        interference_dense=hw.interference_dense,
        interference_moe=hw.interference_moe,
        update_s=step + scalar + gather + rmu_extra_s,
    )


def checkpoint_save_s(hw: HardwareConfig, model: ModelConfig, par: ParallelConfig) -> float:
    """T_ckpt: excess time of an iteration that commits an in-memory checkpoint (Gemini-style).

    The GPU's checkpoint shard is copied to remote host memory over the network while training
    traffic shares it; the achieved share is `ckpt_net_fraction` (see docs, "Calibration").
    """
    pl = place(model, par)
    return pl.ckpt_bytes / (hw.inter_node_bytes_per_s * hw.ckpt_net_fraction)


def checkpoint_load_s(
    hw: HardwareConfig, model: ModelConfig, par: ParallelConfig, *, remote: bool
) -> float:
    """Time to restore one GPU's checkpoint shard: from a remote host (spare-based recovery) at
    the same achieved network share as a save, or from local host memory over PCIe."""
    pl = place(model, par)
    if remote:
        return pl.ckpt_bytes / (hw.inter_node_bytes_per_s * hw.ckpt_net_fraction)
    return pl.ckpt_bytes / hw.pcie_bytes_per_s


def rmu_overhead_s(
    hw: HardwareConfig, model: ModelConfig, par: ParallelConfig, rmu: RmuConfig | None = None
) -> float:
    """RMU's extra time per iteration (Leto §5.2, Pseudocode 1), which gives omega.

    Counted from the pseudocode, each a streaming pass at HBM speed: gradient parity reads the
    gradient buffer once (line 3); the undo copy reads and writes each chunk (line 8); the parity
    delta reads the undo copy and the updated chunk (line 10). Host parity (H1/D of the state)
    crosses PCIe twice (lines 6 and 12).
    """
    rmu = rmu or RmuConfig()
    pl = place(model, par)
    hbm = hw.hbm_bytes_per_s * hw.hbm_efficiency
    passes = (pl.grad_bytes + 4 * pl.model_state_bytes) / hbm
    parity = 2 * pl.model_state_bytes * rmu.parity_pages / rmu.data_pages / hw.pcie_bytes_per_s
    return passes + parity
