"""Closed-form ETTR of Leto App. C.3 (equations 1-8) and checks of its assumptions.

Owns ETTR = (T_iter / T_eff) (1 - T_rec / MTTF) with T_rec = T_det + T_init + L T_eff averaged
over failure kinds, and the list of assumptions a given scenario violates. It never simulates;
`des.py` does, and the two must agree where the assumptions hold.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from unbroken.sim.policy import FailureMix, PolicyTerms

__all__ = ["OVERLAP_LIMIT", "REC_RATIO_LIMIT", "ClosedForm", "closed_form", "recovery_time"]

# Where "T_rec << MTTF" stops being a safe reading of assumption (1): the linear factor
# 1 - T_rec/MTTF then over-charges by about (T_rec/MTTF)^2 / 2 against the exponential one,
# i.e. more than half a point at 0.1.
REC_RATIO_LIMIT = 0.1
# Expected share of failures that land inside another failure's detection + initialization.
OVERLAP_LIMIT = 0.03


@dataclass(kw_only=True, slots=True)
class ClosedForm:
    """The closed-form prediction for one policy and failure mix."""

    ettr: float
    """Predicted ETTR in [0, 1] (clamped at 0 when T_rec >= MTTF)."""
    t_eff_s: float
    """T_eff."""
    t_rec_s: float
    """Mean T_rec over failure kinds."""
    t_rec_by_kind: dict[str, float]
    """T_rec per failure kind (only kinds with nonzero probability)."""
    overlap_share: float
    """Expected share of failures arriving during another's detection + initialization."""
    warnings: list[str] = field(default_factory=list)
    """Assumptions of Eq. 6 that this scenario breaks, one line each."""


def recovery_time(terms: PolicyTerms, kind: str) -> float:
    """T_rec of one failure kind: degraded time + T_det + T_init + L * T_eff."""
    cost = terms.costs[kind]
    return cost.degraded_s + cost.detect_s + cost.init_s + cost.lost_iters * terms.t_eff_s


def closed_form(terms: PolicyTerms, mix: FailureMix) -> ClosedForm:
    """Evaluate Eq. 6 with the policy's terms, averaging T_rec over the failure kinds."""
    fractions = {k: p for k, p in mix.fractions.items() if p > 0}
    by_kind = {k: recovery_time(terms, k) for k in fractions}
    t_rec = sum(p * by_kind[k] for k, p in fractions.items())
    t_eff = terms.t_eff_s
    ratio = t_rec / mix.mttf_s
    ettr = max(0.0, terms.t_iter_s / t_eff * (1.0 - ratio))
    busy = sum(
        p * (terms.costs[k].detect_s + terms.costs[k].init_s + terms.costs[k].degraded_s)
        for k, p in fractions.items()
    )
    overlap = 1.0 - math.exp(-busy / mix.mttf_s)
    warnings = []
    if ratio >= 1.0:
        warnings.append(
            f"T_rec ({t_rec:.0f} s) >= MTTF ({mix.mttf_s:.0f} s): the job never makes progress "
            "in the closed form; use the discrete-event mode"
        )
    elif ratio > REC_RATIO_LIMIT:
        warnings.append(
            f"T_rec/MTTF = {ratio:.2f} > {REC_RATIO_LIMIT}: recovery is not short against the "
            "time between failures (assumption 1), the linear recovery factor is approximate"
        )
    if overlap > OVERLAP_LIMIT:
        warnings.append(
            f"{overlap:.1%} of failures are expected to arrive during another recovery "
            "(assumption 2, no overlapping failures, does not hold)"
        )
    if terms.interval and terms.usable_lag and terms.t_ckpt_s > terms.t_iter_s:
        warnings.append(
            f"checkpoint transfer ({terms.t_ckpt_s:.1f} s) outlasts an iteration "
            f"({terms.t_iter_s:.1f} s): it is not usable after one step as L = I/2 + 1 assumes"
        )
    return ClosedForm(
        ettr=ettr,
        t_eff_s=t_eff,
        t_rec_s=t_rec,
        t_rec_by_kind=by_kind,
        overlap_share=overlap,
        warnings=warnings,
    )
