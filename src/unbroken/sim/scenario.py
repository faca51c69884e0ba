"""Scenarios: what `unbroken simulate` evaluates, read from a preset or a user's cluster.toml.

Owns the top-level config format (documented in docs/simulator.md and examples/cluster.toml),
turning each workload into `StepCosts` (through the analytic model or a profile), and evaluating
every (workload, MTTF, HOF ratio, policy) combination into result rows, closed form and
optionally discrete-event. It prints nothing; `report.py` and the CLI present the rows.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from unbroken.errors import UserError
from unbroken.sim._load import build, check_range, read_toml
from unbroken.sim.analytic import (
    RmuConfig,
    analytic_inputs,
    checkpoint_load_s,
    checkpoint_save_s,
    rmu_overhead_s,
)
from unbroken.sim.des import Failure, simulate, simulate_once
from unbroken.sim.ettr import OVERLAP_LIMIT, closed_form
from unbroken.sim.itertime import IterationBreakdown, iteration_time
from unbroken.sim.policy import POLICIES, FailureMix, RecoveryConfig, StepCosts, policy_terms
from unbroken.sim.presets import load_hardware, load_model
from unbroken.sim.profile import load_profile
from unbroken.sim.trace import read_trace

__all__ = [
    "DesConfig",
    "Scenario",
    "SweepConfig",
    "Workload",
    "WorkloadConfig",
    "evaluate",
    "load_scenario",
    "preset_names",
    "workload_steps",
    "workload_summary",
]


@dataclass(kw_only=True, slots=True, frozen=True)
class WorkloadConfig:
    """One `[[workload]]` table: a model on a cluster, or a measured profile."""

    label: str = ""
    """Name printed in the `model` column; defaults to the model preset's name."""
    model: Any = None
    """A model preset name, or a table of model keys (optionally `preset = NAME`)."""
    parallel: Any = None
    """Parallel-layout keys overriding the model preset's (dp, tp, pp, ep, vpp, micro_batch,
    global_batch, sharded_optimizer, activation_recompute, overlap_grad_reduce)."""
    hardware: Any = None
    """A hardware preset name, or a table of hardware keys (optionally `preset = NAME`)."""
    profile: str = ""
    """Path of a per-stage profile JSON (relative to the config file); replaces model and
    hardware for timing."""
    t_iter_s: float = 0.0
    """A measured iteration time that replaces the modelled T_iter (0 = model it)."""
    t_ckpt_s: float = 0.0
    """A measured per-checkpoint cost that replaces the modelled T_ckpt and checkpoint loads
    (0 = model it)."""

    def __post_init__(self) -> None:
        if self.t_iter_s < 0 or self.t_ckpt_s < 0:
            raise UserError("t_iter_s and t_ckpt_s must be >= 0")


@dataclass(kw_only=True, slots=True, frozen=True)
class SweepConfig:
    """The `[failures]` table: which failure regimes to evaluate."""

    mttf_s: tuple[float, ...] = (600.0,)
    """Job MTTFs in seconds (each one is a separate set of rows)."""
    hof_ratio: tuple[float, ...] = (0.0, 0.5, 1.0)
    """HOF ratios h."""
    fail_slow_ratio: float = 0.0
    """Share of failures that are fail-slow (the rest of 1 - h is fatal)."""
    trace: str = ""
    """A failure trace CSV (relative to the config file); the DES then replays it instead of
    drawing Poisson arrivals, and the closed form uses the trace's MTTF and HOF ratio."""

    def __post_init__(self) -> None:
        if not self.mttf_s or min(self.mttf_s) <= 0:
            raise UserError("mttf_s needs at least one positive value")
        if not self.hof_ratio or not all(0.0 <= h <= 1.0 for h in self.hof_ratio):
            raise UserError("hof_ratio values must lie in [0, 1]")
        check_range(self, "fail_slow_ratio", 0.0, 1.0)


@dataclass(kw_only=True, slots=True, frozen=True)
class DesConfig:
    """The `[simulate]` table: policies and the discrete-event mode."""

    policies: tuple[str, ...] = POLICIES
    """Policies to evaluate (inplace, gemini+, gemini, jit); inapplicable ones are skipped."""
    des: bool = False
    """Also run the discrete-event simulation for every row."""
    horizon_mttf: float = 2000.0
    """Simulated time per replication, in MTTFs."""
    replications: int = 10
    """Independent replications (for the confidence interval)."""
    seed: int = 0
    """Base random seed."""

    def __post_init__(self) -> None:
        for p in self.policies:
            if p not in POLICIES:
                raise UserError(f"unknown policy {p!r} (known: {', '.join(POLICIES)})")
        check_range(self, "horizon_mttf", 1.0, 1e7)
        check_range(self, "replications", 1, 10000)


@dataclass(kw_only=True, slots=True)
class Workload:
    """A resolved workload: its label, size and step costs."""

    label: str
    """Printed in the `model` column."""
    gpus: int
    """GPUs in the job."""
    hardware: str
    """Hardware name ("profile" for a measured profile)."""
    steps: StepCosts
    """What the policies combine: T_iter, T_ckpt, loads, RMU time."""
    breakdown: IterationBreakdown | None = None
    """The terms of the modelled T_iter (None when T_iter was given as a measurement)."""


@dataclass(kw_only=True, slots=True)
class Scenario:
    """Everything one `unbroken simulate` invocation evaluates."""

    name: str
    """Scenario name (chart file name and JSON `scenario`)."""
    workloads: list[Workload]
    """The resolved workloads."""
    sweep: SweepConfig
    """MTTFs and HOF ratios."""
    recovery: RecoveryConfig
    """Recovery step costs."""
    sim: DesConfig
    """Policies and discrete-event settings."""
    trace: list[Failure] | None = None
    """A failure trace to replay instead of Poisson arrivals."""
    notes: list[str] = field(default_factory=list)
    """Free-form notes for the report."""


def workload_steps(
    model_spec: Any,
    parallel: dict[str, Any] | None,
    hardware_spec: Any,
    rmu: RmuConfig | None = None,
    where: str = "workload",
) -> Workload:
    """Resolve a model on a cluster into `StepCosts` through the analytic model."""
    model, par = load_model(model_spec, parallel, where=f"{where}.model")
    hw = load_hardware(hardware_spec, where=f"{where}.hardware")
    breakdown = iteration_time(analytic_inputs(hw, model, par))
    steps = StepCosts(
        t_iter_s=breakdown.iter_s,
        t_ckpt_s=checkpoint_save_s(hw, model, par),
        load_remote_s=checkpoint_load_s(hw, model, par, remote=True),
        load_local_s=checkpoint_load_s(hw, model, par, remote=False),
        rmu_s=rmu_overhead_s(hw, model, par, rmu),
        gpus=par.world,
        replicated_optimizer=not par.sharded_optimizer,
    )
    return Workload(
        label=model.name, gpus=par.world, hardware=hw.name, steps=steps, breakdown=breakdown
    )


def _measured(steps: StepCosts, t_iter_s: float, t_ckpt_s: float) -> StepCosts:
    """Replace modelled step costs by measured ones; a remote checkpoint load moves the same
    bytes at the same achieved rate as a save, a local one keeps its modelled ratio."""
    out = steps
    if t_iter_s:
        out = dataclasses.replace(out, t_iter_s=t_iter_s)
    if t_ckpt_s:
        ratio = steps.load_local_s / steps.t_ckpt_s if steps.t_ckpt_s else 0.0
        out = dataclasses.replace(
            out, t_ckpt_s=t_ckpt_s, load_remote_s=t_ckpt_s, load_local_s=ratio * t_ckpt_s
        )
    return out


def _tuple(table: dict[str, Any], key: str) -> None:
    if key in table and not isinstance(table[key], list | tuple):
        table[key] = [table[key]]


def scenario_from_table(raw: dict[str, Any], where: str, base: Path) -> Scenario:
    """Build a `Scenario` from a parsed config table.

    Raises:
        UserError: unknown section or key, invalid values, unreadable referenced files.
    """
    known = {"name", "workload", "failures", "recovery", "rmu", "simulate"}
    for key in raw:
        if key not in known:
            raise UserError(f"{where}: unknown section {key!r} (known: {', '.join(sorted(known))})")
    rmu = build(RmuConfig, raw.get("rmu", {}), f"{where} [rmu]")
    recovery = build(RecoveryConfig, raw.get("recovery", {}), f"{where} [recovery]")
    failures = dict(raw.get("failures", {}))
    _tuple(failures, "mttf_s")
    _tuple(failures, "hof_ratio")
    sweep = build(SweepConfig, failures, f"{where} [failures]")
    sim = build(DesConfig, raw.get("simulate", {}), f"{where} [simulate]")
    tables = raw.get("workload")
    if isinstance(tables, dict):
        tables = [tables]
    if not tables:
        raise UserError(f"{where}: no [[workload]] table")
    workloads = []
    for i, table in enumerate(tables):
        w_where = f"{where} [[workload]] #{i + 1}"
        wc = build(WorkloadConfig, table, w_where)
        if wc.profile and (wc.model is not None or wc.hardware is not None):
            raise UserError(f"{w_where}: give either profile or model + hardware, not both")
        if wc.profile:
            inputs, steps = load_profile(base / wc.profile)
            label = wc.label or Path(wc.profile).stem
            workloads.append(
                Workload(
                    label=label,
                    gpus=steps.gpus,
                    hardware="profile",
                    steps=steps,
                    breakdown=iteration_time(inputs),
                )
            )
            continue
        if wc.model is None or wc.hardware is None:
            raise UserError(f"{w_where}: needs model and hardware (or a profile)")
        wl = workload_steps(wc.model, wc.parallel, wc.hardware, rmu, w_where)
        if wc.label:
            wl.label = wc.label
        if wc.t_iter_s or wc.t_ckpt_s:
            wl.steps = _measured(wl.steps, wc.t_iter_s, wc.t_ckpt_s)
            if wc.t_iter_s:
                wl.breakdown = None
        workloads.append(wl)
    trace = read_trace(base / sweep.trace) if sweep.trace else None
    return Scenario(
        name=str(raw.get("name", Path(where).stem)),
        workloads=workloads,
        sweep=sweep,
        recovery=recovery,
        sim=sim,
        trace=trace,
    )


def workload_summary(wl: Workload) -> dict[str, Any]:
    """The per-workload terms behind the rows: T_iter breakdown, T_ckpt, loads, omega."""
    out: dict[str, Any] = {
        "model": wl.label,
        "gpus": wl.gpus,
        "hardware": wl.hardware,
        "t_iter_s": wl.steps.t_iter_s,
        "t_ckpt_s": wl.steps.t_ckpt_s,
        "load_remote_s": wl.steps.load_remote_s,
        "load_local_s": wl.steps.load_local_s,
        "omega": wl.steps.rmu_s / wl.steps.t_iter_s,
    }
    if wl.breakdown is not None:
        b = wl.breakdown
        out.update(
            t_pipeline_s=b.pipeline_s,
            t_sync_s=b.sync_s,
            t_sync_serial_s=b.sync_serial_s,
            exposed_s=b.exposed_s,
            t_update_s=b.update_s,
        )
    return out


def preset_names() -> list[str]:
    """Scenario presets shipped with the simulator (`--preset NAME`)."""
    folder = resources.files("unbroken.sim").joinpath("presets")
    return sorted(
        p.name.removesuffix(".toml")
        for p in folder.iterdir()
        if p.name.endswith(".toml") and p.name not in ("hardware.toml", "models.toml")
    )


def load_scenario(*, preset: str | None = None, config: str | Path | None = None) -> Scenario:
    """Load a scenario preset by name or a user's cluster config file.

    Raises:
        UserError: unknown preset, unreadable or invalid config.
    """
    if (preset is None) == (config is None):
        raise UserError("give exactly one of --preset or --config")
    if preset is not None:
        if preset not in preset_names():
            raise UserError(f"unknown preset {preset!r} (known: {', '.join(preset_names())})")
        import tomllib

        text = resources.files("unbroken.sim").joinpath("presets").joinpath(f"{preset}.toml")
        raw = tomllib.loads(text.read_text())
        return scenario_from_table(raw, f"preset {preset}", Path("."))
    path = Path(config)  # type: ignore[arg-type]
    return scenario_from_table(read_toml(path), str(path), path.parent)


def _trace_mix(trace: list[Failure]) -> FailureMix:
    span = trace[-1].t_s if trace else 0.0
    n = len(trace)
    if n == 0 or span <= 0:
        raise UserError("the failure trace needs at least one failure after t = 0")
    hof = sum(f.kind == "hof" for f in trace) / n
    slow = sum(f.kind == "fail-slow" for f in trace) / n
    return FailureMix(mttf_s=span / n, hof_ratio=hof, fail_slow_ratio=slow)


def _closed_form_row(wl, mix: FailureMix, policy: str, terms, cf) -> dict[str, Any]:
    """One combination's row from the closed-form model `cf` of `terms`."""
    interval = terms.interval or (1 if terms.costs["fatal"].rollback is False else 0)
    return {
        "model": wl.label,
        "gpus": wl.gpus,
        "mttf_s": mix.mttf_s,
        "hof_ratio": mix.hof_ratio,
        "policy": policy,
        "ettr": cf.ettr,
        "t_iter_s": terms.t_iter_s,
        "t_rec_s": cf.t_rec_s,
        "ckpt_interval": interval,
        "t_eff_s": cf.t_eff_s,
        "t_rec_by_kind_s": cf.t_rec_by_kind,
        "recovery_by_kind": {
            k: {
                "detect_s": terms.costs[k].detect_s,
                "init_s": terms.costs[k].init_s,
                "recompute_s": terms.costs[k].lost_iters * cf.t_eff_s,
                "degraded_s": terms.costs[k].degraded_s,
            }
            for k in cf.t_rec_by_kind
        },
        "hardware": wl.hardware,
        "warnings": list(cf.warnings),
    }


def _add_des(
    row: dict[str, Any], scenario: Scenario, terms, mix: FailureMix, cf, slow, progress
) -> None:
    """Add the discrete-event figures (over the trace, or replicated runs of `mix`) and their
    warnings to `row`."""
    if scenario.trace is not None:
        horizon = scenario.trace[-1].t_s + mix.mttf_s
        run = simulate_once(terms, trace=scenario.trace, horizon_s=horizon, slow=slow)
        row.update(ettr_des=run.ettr, ettr_des_ci95=None)
        row["des_overlapping"] = run.overlapping
    else:
        res = simulate(
            terms,
            mix,
            horizon_s=scenario.sim.horizon_mttf * mix.mttf_s,
            replications=scenario.sim.replications,
            seed=scenario.sim.seed,
            slow=slow,
            progress=progress,
        )
        row.update(ettr_des=res.ettr, ettr_des_ci95=res.ci95)
        row["des_overlapping"] = res.overlapping
        crashes = sum(res.failures.values())
        if crashes and res.overlapping / crashes > OVERLAP_LIMIT:
            row["warnings"].append(
                f"{res.overlapping / crashes:.1%} of failures overlapped a "
                "recovery in the discrete-event run (assumption 2)"
            )
        gap = abs(res.ettr - cf.ettr)
        if gap > 0.01 and not math.isnan(gap):
            row["warnings"].append(
                f"discrete-event and closed form differ by {gap * 100:.1f} "
                "points; trust the discrete-event value"
            )


def evaluate(
    scenario: Scenario, *, des: bool | None = None, progress: Callable[[str], None] | None = None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Evaluate every combination of the scenario.

    Args:
        scenario: the loaded scenario.
        des: override `scenario.sim.des`.
        progress: receives one-line progress messages (discrete-event runs).

    Returns:
        (rows, skipped): one dict per evaluated combination, and one per inapplicable policy.
    """
    run_des = scenario.sim.des if des is None else des
    rows: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    rec = scenario.recovery
    slow = (rec.fail_slow_detect_s, rec.fail_slow_factor)
    if scenario.trace is not None:
        mixes = [_trace_mix(scenario.trace)]
    else:
        mixes = [
            FailureMix(mttf_s=m, hof_ratio=h, fail_slow_ratio=scenario.sweep.fail_slow_ratio)
            for m in scenario.sweep.mttf_s
            for h in scenario.sweep.hof_ratio
        ]
    for wl in scenario.workloads:
        for mix in mixes:
            for policy in scenario.sim.policies:
                terms = policy_terms(policy, wl.steps, mix, rec)
                if not terms.applicable:
                    entry = {"model": wl.label, "policy": policy, "reason": terms.reason}
                    if entry not in skipped:
                        skipped.append(entry)
                    continue
                cf = closed_form(terms, mix)
                row = _closed_form_row(wl, mix, policy, terms, cf)
                if run_des:
                    if progress is not None:
                        progress(f"{wl.label} h={mix.hof_ratio:g} mttf={mix.mttf_s:g}s {policy}")
                    _add_des(row, scenario, terms, mix, cf, slow, progress)
                rows.append(row)
    return rows, skipped
