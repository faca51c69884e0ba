"""Where the simulator's measured constants come from: the Leto paper's Kimi-MoE numbers.

Owns the derivation (not the values in use: those live in `presets/hardware.toml` and the
`RecoveryConfig` defaults, and tests/sim/test_calibration.py checks that they match what this
module derives). Inputs, all measured on the paper's 64-GPU p4d testbed (§8.1):

- Table 6: Kimi-MoE's iteration time, 9.097 s.
- Table 4: Gemini's tuned checkpoint interval for Kimi-MoE, 11 / 19 / 27 iterations at MTTF
  10 / 30 / 60 min. App. A.2 chose these with Young's formula I = sqrt(2 p MTTF / t_iter), so
  p = I^2 t_iter / (2 MTTF): the measured normalized checkpoint cost.
- Table 3: recovery initialization of Gemini 59 s, Gemini+ 35 s, Leto 15 s (I = 11) and 13 s
  (I = 32); detection under 1 s (§8.1).
"""

from __future__ import annotations

import statistics
from types import MappingProxyType

from unbroken.sim.policy import RecoveryConfig
from unbroken.sim.presets import load_hardware, load_model
from unbroken.sim.workload import place

__all__ = ["KIMI", "derive_ckpt_net_fraction", "derive_recovery", "measured_ckpt_s"]

KIMI = MappingProxyType(
    {
        "t_iter_s": 9.097,  # Table 6, measured
        "gemini_interval": {600.0: 11, 1800.0: 19, 3600.0: 27},  # Table 4
        "init_gemini_s": 59.0,  # Table 3
        "init_gemini_plus_s": 35.0,  # Table 3
        "init_leto_s": (15.0, 13.0),  # Table 3, intervals 11 and 32
        "detect_s": 1.0,  # §8.1: "detects termination in under 1 s"
    }
)


def measured_ckpt_s() -> float:
    """Kimi-MoE's per-checkpoint cost T_ckpt = p * t_iter, p inverted from Young's formula."""
    t = KIMI["t_iter_s"]
    ps = [i * i * t / (2.0 * mttf) for mttf, i in KIMI["gemini_interval"].items()]
    return statistics.fmean(ps) * t


def derive_ckpt_net_fraction() -> float:
    """Share of the per-GPU network bandwidth that Gemini's checkpoint traffic achieved:
    Kimi-MoE's checkpoint bytes per GPU (this model's placement) / (T_ckpt * bandwidth)."""
    model, par = load_model("kimi-moe")
    hw = load_hardware("a100-p4d")
    return place(model, par).ckpt_bytes / (measured_ckpt_s() * hw.inter_node_bytes_per_s)


def derive_recovery() -> RecoveryConfig:
    """The `RecoveryConfig` the paper's Table 3 implies (loads at the derived bandwidth)."""
    det = KIMI["detect_s"]
    load = measured_ckpt_s()  # a remote load moves the same bytes at the same achieved rate
    return RecoveryConfig(
        detect_s=det,
        process_start_s=KIMI["init_gemini_s"] - KIMI["init_gemini_plus_s"],
        rank_setup_s=KIMI["init_gemini_plus_s"] - det - load,
        takeover_s=statistics.fmean(KIMI["init_leto_s"]) - det,
    )
