"""Hardware description for the iteration-time and recovery models (Leto App. C.1, input (b)).

Owns `HardwareConfig`: per-GPU compute, memory and network capabilities plus the two calibrated
interference constants of App. C.1.3. Every preset value lives in `presets/hardware.toml` with
its source; this module holds no numbers of its own beyond field defaults that say "unknown".
"""

from __future__ import annotations

from dataclasses import dataclass

from unbroken.sim._load import check_positive, check_range

__all__ = ["HardwareConfig"]


@dataclass(kw_only=True, slots=True, frozen=True)
class HardwareConfig:
    """One GPU type in one cluster fabric, as the simulator sees it."""

    name: str = "custom"
    """Label printed in reports."""
    gpus_per_node: int = 8
    """GPUs sharing one NVLink domain; groups larger than this cross the inter-node fabric."""
    peak_flops: float
    """Dense BF16 tensor-core peak per GPU, FLOP/s (vendor datasheet)."""
    compute_efficiency: float = 0.6
    """Fraction of `peak_flops` a transformer layer's GEMMs reach (bracket-level, no comm)."""
    hbm_bytes_per_s: float
    """HBM bandwidth per GPU, bytes/s (datasheet)."""
    hbm_efficiency: float = 0.8
    """Fraction of `hbm_bytes_per_s` that streaming kernels (optimizer, copies, parity) reach."""
    intra_node_bytes_per_s: float
    """Achievable per-GPU bus bandwidth of NVLink collectives, bytes/s, one direction."""
    intra_node_latency_s: float = 5e-6
    """Per-step latency of an intra-node collective, s."""
    inter_node_bytes_per_s: float
    """Per-GPU share of the node's network bandwidth, bytes/s, one direction."""
    inter_node_latency_s: float = 2e-5
    """Per-step latency of an inter-node collective or point-to-point send, s."""
    pcie_bytes_per_s: float
    """Achievable host<->device copy bandwidth per GPU, bytes/s."""
    ckpt_net_fraction: float
    """Fraction of `inter_node_bytes_per_s` that in-memory checkpoint traffic to a remote host
    achieves while training runs (derived from the paper's Kimi-MoE measurements; see
    docs/simulator.md, "Calibration")."""
    concurrency_penalty: float = 1.0
    """Slowdown of a gradient bucket's collective when it runs next to other collectives (C.1.3);
    1.0 means no measured penalty."""
    interference_dense: float = 0.0
    """c of C.1.3: residual cost per second of communication hidden under dense compute."""
    interference_moe: float = 0.5
    """f of C.1.3: fraction of min(G, A) lost when gradient sync and inter-node MoE all-to-all
    share the fabric; physically in [0, 1]. The default is the midpoint, absent a profile."""

    def __post_init__(self) -> None:
        check_positive(
            self,
            "gpus_per_node",
            "peak_flops",
            "hbm_bytes_per_s",
            "intra_node_bytes_per_s",
            "inter_node_bytes_per_s",
            "pcie_bytes_per_s",
        )
        check_range(self, "compute_efficiency", 1e-3, 1.0)
        check_range(self, "hbm_efficiency", 1e-3, 1.0)
        check_range(self, "ckpt_net_fraction", 1e-4, 1.0)
        check_range(self, "interference_dense", 0.0, 1.0)
        check_range(self, "interference_moe", 0.0, 1.0)
        check_range(self, "concurrency_penalty", 1.0, 100.0)
        check_range(self, "intra_node_latency_s", 0.0, 1.0)
        check_range(self, "inter_node_latency_s", 0.0, 1.0)
