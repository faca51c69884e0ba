"""Closed-form ETTR (Leto App. C.3, Eq. 6) and its assumption checks."""

from __future__ import annotations

import pytest

from unbroken.sim.ettr import closed_form
from unbroken.sim.policy import FailureMix, StepCosts, policy_terms

STEPS = StepCosts(t_iter_s=10.0, t_ckpt_s=2.0, load_remote_s=3.0, load_local_s=0.5, rmu_s=0.05)


def test_equation_6_by_hand():
    mix = FailureMix(mttf_s=3600.0, hof_ratio=1.0)
    terms = policy_terms("gemini+", STEPS, mix)
    cf = closed_form(terms, mix)
    t_eff = 10.0 + 2.0 / terms.interval
    cost = terms.costs["hof"]
    t_rec = cost.detect_s + cost.init_s + (terms.interval / 2 + 1) * t_eff
    assert cf.t_rec_s == pytest.approx(t_rec)
    assert cf.ettr == pytest.approx(10.0 / t_eff * (1 - t_rec / 3600.0))


def test_mixed_failure_kinds_average_the_recovery_time():
    mix = FailureMix(mttf_s=3600.0, hof_ratio=0.25)
    cf = closed_form(policy_terms("inplace", STEPS, mix), mix)
    assert cf.t_rec_s == pytest.approx(
        0.25 * cf.t_rec_by_kind["hof"] + 0.75 * cf.t_rec_by_kind["fatal"]
    )


def test_assumption_warnings():
    long = FailureMix(mttf_s=36000.0, hof_ratio=1.0)
    assert closed_form(policy_terms("inplace", STEPS, long), long).warnings == []
    short = FailureMix(mttf_s=300.0, hof_ratio=0.0)
    warnings = closed_form(policy_terms("gemini", STEPS, short), short).warnings
    assert any("assumption 1" in w for w in warnings)
    assert any("assumption 2" in w for w in warnings)
    hopeless = FailureMix(mttf_s=30.0, hof_ratio=0.0)
    cf = closed_form(policy_terms("gemini", STEPS, hopeless), hopeless)
    assert cf.ettr == 0.0 and any("never makes progress" in w for w in cf.warnings)
