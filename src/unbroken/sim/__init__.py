"""Cluster simulator: predict iteration time, recovery cost and ETTR at scales we cannot run.

Implements the model of the Leto paper's Appendix C (and §8.1, §8.6, App. A.2, B) for
`unbroken simulate`:

- `itertime` / `analytic` / `profile`: T_iter = T_pipeline + T_sync + T_update (App. C.1) from a
  per-stage profile or from a hardware + model + parallelism description (`presets/`).
- `policy` / `ettr`: the policy-specific terms (in-place, Gemini, Gemini+, JIT) and the closed form
  ETTR = (T_iter / T_eff)(1 - T_rec / MTTF) with its assumption checks (App. C.3).
- `des`: the discrete-event replay (Poisson or trace failures, overlaps, real rollback).
- `scenario` / `report`: presets (`leto-fig14`) and cluster.toml configs, tables, JSON, charts.
- `validate`: predicted against measured ETTR of a real `unbroken train`/`demo` run dir.
- `from_run`: a per-stage profile (input (a)) derived from a real run dir's timings.
- `calibration`: where the measured constants come from.

The simulator never imports torch and never touches a running job; it reads run outputs only.
See docs/simulator.md for every input, assumption and limit.
"""

from unbroken.sim.des import DesResult, Failure, simulate, simulate_once
from unbroken.sim.ettr import ClosedForm, closed_form
from unbroken.sim.from_run import RunProfile, profile_from_run
from unbroken.sim.hardware import HardwareConfig
from unbroken.sim.itertime import IterationBreakdown, IterationInputs, iteration_time
from unbroken.sim.policy import (
    POLICIES,
    FailureMix,
    PolicyTerms,
    RecoveryConfig,
    StepCosts,
    policy_terms,
    young_interval,
)
from unbroken.sim.scenario import Scenario, evaluate, load_scenario
from unbroken.sim.validate import Validation, validate_run
from unbroken.sim.workload import ModelConfig, ParallelConfig

__all__ = [
    "POLICIES",
    "ClosedForm",
    "DesResult",
    "Failure",
    "FailureMix",
    "HardwareConfig",
    "IterationBreakdown",
    "IterationInputs",
    "ModelConfig",
    "ParallelConfig",
    "PolicyTerms",
    "RecoveryConfig",
    "RunProfile",
    "Scenario",
    "StepCosts",
    "Validation",
    "closed_form",
    "evaluate",
    "iteration_time",
    "load_scenario",
    "policy_terms",
    "profile_from_run",
    "simulate",
    "simulate_once",
    "validate_run",
    "young_interval",
]
