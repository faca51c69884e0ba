"""Policy terms (Leto App. C.3 eqs. 7-8, App. A.2 intervals)."""

from __future__ import annotations

import math

import pytest

from unbroken.errors import UserError
from unbroken.sim.ettr import closed_form
from unbroken.sim.policy import (
    FailureMix,
    RecoveryConfig,
    StepCosts,
    policy_terms,
    young_interval,
)

STEPS = StepCosts(
    t_iter_s=10.0, t_ckpt_s=2.0, load_remote_s=3.0, load_local_s=0.5, rmu_s=0.05, gpus=1024
)


def test_young_interval():
    # I* = sqrt(2 p MTTF / t_iter), p = T_ckpt / t_iter: sqrt(2 * 0.2 * 600 / 10) = 4.9 -> 5.
    assert young_interval(2.0, 600.0, 10.0, cap=100) == 5
    assert young_interval(2.0, math.inf, 10.0, cap=100) == 100
    assert young_interval(1e-6, 600.0, 10.0, cap=100) == 1


def test_gemini_plus_matches_equation_7():
    mix = FailureMix(mttf_s=600.0, hof_ratio=0.5)
    t = policy_terms("gemini+", STEPS, mix)
    assert t.interval == 5
    assert t.t_eff_s == pytest.approx(10.0 + 2.0 / 5)
    assert t.costs["hof"].lost_iters == pytest.approx(5 / 2 + 1)
    assert t.costs["hof"].init_s == t.costs["fatal"].init_s  # spares for both kinds


def test_inplace_matches_equation_8_and_uses_the_fatal_mttf():
    rec = RecoveryConfig()
    for h in (0.0, 0.5, 0.9):
        mix = FailureMix(mttf_s=600.0, hof_ratio=h)
        t = policy_terms("inplace", STEPS, mix, rec)
        assert t.interval == young_interval(2.0, 600.0 / (1 - h), 10.0, rec.max_interval)
        assert t.omega == pytest.approx(0.005)
        assert t.costs["hof"].lost_iters == 0.5
        assert not t.costs["hof"].rollback
        assert t.costs["fatal"].rollback
    t = policy_terms("inplace", STEPS, FailureMix(mttf_s=600.0, hof_ratio=1.0), rec)
    assert t.interval == rec.max_interval


def test_inplace_fatal_path_is_gemini_plus():
    mix = FailureMix(mttf_s=600.0, hof_ratio=0.0)
    inplace = policy_terms("inplace", STEPS, mix)
    plus = policy_terms("gemini+", STEPS, mix)
    assert inplace.interval == plus.interval
    assert inplace.costs["fatal"] == plus.costs["fatal"]
    # At h = 0 in-place trails only by its steady overhead omega.
    gap = closed_form(plus, mix).ettr - closed_form(inplace, mix).ettr
    assert 0 < gap < 0.01


def test_jit_needs_replicated_optimizer_states():
    mix = FailureMix(mttf_s=600.0, hof_ratio=0.5)
    assert not policy_terms("jit", STEPS, mix).applicable
    replicated = StepCosts(t_iter_s=10.0, t_ckpt_s=2.0, load_remote_s=3.0, load_local_s=0.5,
                           replicated_optimizer=True)  # fmt: skip
    jit = policy_terms("jit", replicated, mix)
    assert jit.applicable and jit.costs["fatal"].lost_iters == 0.5
    # Leto falls back to JIT+ for fatal failures when the optimizer is replicated (§8.1):
    # no rollback, and a preinitialized spare saves the process start.
    fallback = policy_terms("inplace", replicated, mix).costs["fatal"]
    assert not fallback.rollback
    assert jit.costs["fatal"].init_s - fallback.init_s == pytest.approx(
        RecoveryConfig().process_start_s
    )


def test_gemini_pays_process_start_that_gemini_plus_avoids():
    mix = FailureMix(mttf_s=600.0, hof_ratio=1.0)
    rec = RecoveryConfig()
    gem = policy_terms("gemini", STEPS, mix, rec).costs["hof"].init_s
    plus = policy_terms("gemini+", STEPS, mix, rec).costs["hof"].init_s
    assert gem - plus == pytest.approx(
        rec.process_start_s - STEPS.load_remote_s + STEPS.load_local_s
    )


def test_bad_inputs_are_user_errors():
    with pytest.raises(UserError):
        policy_terms("checkfreq", STEPS, FailureMix(mttf_s=600.0, hof_ratio=0.5))
    with pytest.raises(UserError):
        FailureMix(mttf_s=600.0, hof_ratio=0.8, fail_slow_ratio=0.5)
    with pytest.raises(UserError):
        RecoveryConfig(fail_slow_factor=0.5)
