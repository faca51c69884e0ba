"""The workload and fabric model the planner prices plans with: per-layer time and memory.

Owns `Workload` and `Fabric`. A micro-batch of N tokens whose documents have lengths l_i costs,
per transformer layer and forward pass on one healthy device, the workload model of ResiHP eq. 1
(`unbroken.detect.workload`) at layer granularity:

    T_layer = alpha N + beta sum l_i^2

(alpha: the projections and MLP, beta: block-diagonal causal attention), the backward pass
`backward_ratio` times that, the output head and loss on the last stage, the embedding on the
first. A TP group of k devices divides the compute by k and adds, per layer and pass, the
sequence-parallel collectives of Megatron: two all-gathers and two reduce-scatters of the
N x hidden activation ([Note: collective cost model] in `unbroken.sim.analytic`). Every
micro-batch is priced at the *expected* sum l_i^2 of the data: a plan serves many iterations,
and which documents one iteration packs is the detector's business, not the planner's.

Memory per device: model state (weights, gradients and Adam moments, `state_bytes_per_param`
per parameter, sharded over TP) + the activations each in-flight micro-batch keeps (per layer,
sequence-parallel, so divided by k) + the logits on the last stage + a reserve.

`Workload.from_model` derives every constant from a `unbroken.sim` model and hardware preset
(FLOPs at the preset's efficiency; activation bytes 34·N·hidden per layer, Korthikanti et al.
with flash attention); `Workload.calibrated` rescales the compute to a measured per-layer time
(a profile from `unbroken simulate --profile-from`, or the H200 measurements). Pure arithmetic.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

from unbroken.sim.hardware import HardwareConfig
from unbroken.sim.workload import ModelConfig

__all__ = ["Fabric", "Workload"]

ACT_BYTES = 2
"""bf16 activations between stages and in TP collectives."""
LAYER_ACT_FACTOR = 34
"""Activation bytes kept per token per hidden unit per layer (Korthikanti et al. 2022, with
flash attention, no recomputation); sequence parallelism divides it by the TP degree."""
STEP_BYTES = 30
"""Optimizer step bytes moved per local parameter (as `unbroken.sim.analytic.STEP_BYTES`)."""
RESERVED_BYTES = 2 * 2**30
"""Assumed per-device reserve: CUDA context and cuBLAS (716 MiB measured on the H200,
PLATFORM-FACTS), NCCL buffers, allocator fragmentation."""


def ring_s(nbytes: float, n: int, bandwidth: float, latency: float) -> float:
    """One ring all-gather or reduce-scatter of `nbytes` over `n` devices."""
    if n <= 1:
        return 0.0
    return (n - 1) / n * nbytes / bandwidth + (n - 1) * latency


@dataclass(frozen=True, slots=True, kw_only=True)
class Fabric:
    """The interconnect: NVLink inside a node, the network across nodes (per GPU, one way)."""

    gpus_per_node: int = 8
    intra_bytes_per_s: float
    intra_latency_s: float = 5e-6
    inter_bytes_per_s: float
    inter_latency_s: float = 1e-5

    def __post_init__(self) -> None:
        if self.gpus_per_node < 1 or self.intra_bytes_per_s <= 0 or self.inter_bytes_per_s <= 0:
            raise ValueError("gpus_per_node and both bandwidths must be positive")

    @classmethod
    def from_hardware(cls, hw: HardwareConfig) -> Fabric:
        """The fabric of a `unbroken.sim` hardware preset."""
        return cls(
            gpus_per_node=hw.gpus_per_node,
            intra_bytes_per_s=hw.intra_node_bytes_per_s,
            intra_latency_s=hw.intra_node_latency_s,
            inter_bytes_per_s=hw.inter_node_bytes_per_s,
            inter_latency_s=hw.inter_node_latency_s,
        )

    def transfer_s(self, nbytes: float, same_node: bool, link_speed: float = 1.0) -> float:
        """One point-to-point message; `link_speed` slows the network (not NVLink)."""
        if same_node:
            return self.intra_latency_s + nbytes / self.intra_bytes_per_s
        return self.inter_latency_s + nbytes / (self.inter_bytes_per_s * link_speed)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Fabric:
        """Inverse of `to_dict`."""
        return cls(**data)


@dataclass(frozen=True, slots=True, kw_only=True)
class Workload:
    """Per-layer compute and memory of one micro-batch; see the module docstring."""

    num_layers: int
    tokens: int
    """N: tokens per micro-batch (the packing budget)."""
    sum_sq: float
    """Expected sum of squared document lengths of a micro-batch (N^2: one document)."""
    alpha_s: float
    """Forward seconds per token per layer on one healthy device (linear part of eq. 1)."""
    beta_s: float
    """Forward seconds per squared token per layer (attention part of eq. 1)."""
    head_s: float = 0.0
    """Forward seconds of the output head and loss per micro-batch on one device."""
    embed_s: float = 0.0
    """Forward seconds of the embedding per micro-batch on one device."""
    backward_ratio: float = 2.0
    """Backward (input + weight gradients) over forward compute."""
    message_bytes: float
    """One activation (or its gradient) between pipeline stages: N x hidden x 2 bytes."""
    layer_params: float
    embed_params: float = 0.0
    head_params: float = 0.0
    state_bytes_per_param: float = 16.0
    """bf16 weight + fp32 main gradient + fp32 master copy and two Adam moments."""
    grad_bytes_per_param: float = 4.0
    """Bytes per parameter in the data-parallel gradient reduction (fp32 main gradients)."""
    act_bytes_per_layer: float
    """Activation bytes one in-flight micro-batch keeps per layer on one device (TP 1)."""
    head_act_bytes: float = 0.0
    """Logits kept by the last stage per in-flight micro-batch (TP 1)."""
    reserved_bytes: float = RESERVED_BYTES
    step_s_per_param: float = 0.0
    """Optimizer step seconds per local parameter."""
    boundary_sync: bool = False
    """Every rank meets at every iteration boundary (a live job: the placement switch's
    broadcast, the audit's hash gather), so a slow device's long optimizer step is not hidden
    behind the others' next compute: the iteration ends when that step does ([Note: step
    lead] in `unbroken.plan.score`)."""

    def __post_init__(self) -> None:
        if self.num_layers < 1 or self.tokens < 1:
            raise ValueError("num_layers and tokens must be >= 1")
        if min(self.alpha_s, self.beta_s, self.head_s, self.embed_s) < 0:
            raise ValueError("compute costs must be >= 0")
        if self.alpha_s + self.beta_s <= 0:
            raise ValueError("a layer must cost something")

    # -- compute -----------------------------------------------------------------------------
    def layer_s(self) -> float:
        """Forward seconds of one layer for one micro-batch on one healthy device (eq. 1)."""
        return self.alpha_s * self.tokens + self.beta_s * self.sum_sq

    def tp_comm_s(self, tp: int, fabric: Fabric, *, same_node: bool = True) -> float:
        """Sequence-parallel collectives of one layer and one pass on a TP group of `tp`."""
        if same_node:
            bw, lat = fabric.intra_bytes_per_s, fabric.intra_latency_s
        else:
            bw, lat = fabric.inter_bytes_per_s, fabric.inter_latency_s
        return 4 * ring_s(self.message_bytes, tp, bw, lat)

    def stage_compute_s(
        self, layers: tuple[int, int], tp: int, fabric: Fabric, *, same_node: bool = True
    ) -> tuple[float, float]:
        """(forward, backward) seconds of one micro-batch through `layers` on a healthy TP
        group of `tp` devices (slowdowns are applied by the simulator)."""
        n = layers[1] - layers[0]
        forward = n * self.layer_s()
        if layers[0] == 0:
            forward += self.embed_s
        if layers[1] == self.num_layers:
            forward += self.head_s
        comm = n * self.tp_comm_s(tp, fabric, same_node=same_node)
        return forward / tp + comm, self.backward_ratio * forward / tp + comm

    # -- memory ------------------------------------------------------------------------------
    def stage_params(self, layers: tuple[int, int]) -> float:
        """Parameters of a stage (before TP sharding)."""
        params = (layers[1] - layers[0]) * self.layer_params
        if layers[0] == 0:
            params += self.embed_params
        if layers[1] == self.num_layers:
            params += self.head_params
        return params

    def device_bytes(self, layers: tuple[int, int], tp: int, inflight: int) -> float:
        """Peak memory of one device of a TP group of `tp` holding `layers` with `inflight`
        micro-batches' activations alive at once."""
        n = layers[1] - layers[0]
        per_mb = n * self.act_bytes_per_layer
        if layers[1] == self.num_layers:
            per_mb += self.head_act_bytes
        state = self.stage_params(layers) * self.state_bytes_per_param
        return self.reserved_bytes + (state + max(inflight, 1) * per_mb) / tp

    def max_inflight(self, layers: tuple[int, int], tp: int, capacity: float) -> int:
        """Most micro-batches whose activations fit next to the stage's state (0: none)."""
        n = layers[1] - layers[0]
        per_mb = n * self.act_bytes_per_layer
        if layers[1] == self.num_layers:
            per_mb += self.head_act_bytes
        free = (
            capacity
            - self.reserved_bytes
            - self.stage_params(layers) * (self.state_bytes_per_param / tp)
        )
        if free < 0:
            return 0
        return int(free // (per_mb / tp)) if per_mb > 0 else 1 << 30

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def from_model(
        cls,
        model: ModelConfig,
        hw: HardwareConfig,
        *,
        tokens: int | None = None,
        sum_sq: float | None = None,
    ) -> Workload:
        """Price a `unbroken.sim` model on a hardware preset.

        Args:
            model: the model (its `seq_len` is the default token budget).
            hw: the GPU; compute runs at `peak_flops * compute_efficiency`.
            tokens: N per micro-batch (default: the model's sequence length).
            sum_sq: expected sum of squared document lengths (default N^2: one document).
        """
        n = tokens or model.seq_len
        rate = hw.peak_flops * hw.compute_efficiency
        embedding = model.vocab * model.hidden
        layer_params = (model.total_params - model.embedding_params) / model.layers
        return cls(
            num_layers=model.layers,
            tokens=n,
            sum_sq=float(n * n if sum_sq is None else sum_sq),
            alpha_s=2.0 * layer_params / rate,
            beta_s=model.attn_dim / rate,
            head_s=2.0 * n * model.vocab * model.hidden / rate,
            message_bytes=float(n * model.hidden * ACT_BYTES),
            layer_params=layer_params,
            embed_params=float(embedding),
            head_params=float(embedding),
            act_bytes_per_layer=float(LAYER_ACT_FACTOR * n * model.hidden),
            head_act_bytes=float(4 * n * model.vocab),
            step_s_per_param=STEP_BYTES / (hw.hbm_bytes_per_s * hw.hbm_efficiency),
        )

    def calibrated(self, layer_s: float) -> Workload:
        """This workload with its compute rescaled so that one layer's forward takes `layer_s`
        (a measured time, e.g. a profile's bracket time per layer); the alpha : beta and
        layer : head ratios are kept."""
        if layer_s <= 0:
            raise ValueError("a calibrated layer time must be > 0")
        scale = layer_s / self.layer_s()
        return replace(
            self,
            alpha_s=self.alpha_s * scale,
            beta_s=self.beta_s * scale,
            head_s=self.head_s * scale,
            embed_s=self.embed_s * scale,
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Workload:
        """Inverse of `to_dict`."""
        return cls(**data)
