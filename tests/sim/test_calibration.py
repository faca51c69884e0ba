"""The measured constants in use match what the paper's numbers imply (sim/calibration.py)."""

from __future__ import annotations

import pytest

from unbroken.sim.calibration import derive_ckpt_net_fraction, derive_recovery
from unbroken.sim.policy import RecoveryConfig
from unbroken.sim.presets import hardware_names, load_hardware


def test_checkpoint_bandwidth_share_is_the_derived_one():
    derived = derive_ckpt_net_fraction()
    for name in hardware_names():
        assert load_hardware(name).ckpt_net_fraction == pytest.approx(derived, abs=0.001)


def test_recovery_defaults_are_the_derived_ones():
    derived, default = derive_recovery(), RecoveryConfig()
    for field in ("detect_s", "process_start_s", "rank_setup_s", "takeover_s"):
        assert getattr(default, field) == pytest.approx(getattr(derived, field), abs=0.05), field
