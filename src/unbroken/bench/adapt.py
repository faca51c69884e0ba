"""Live reconfiguration benchmark (issue 18): tokens/s after a device slows down or is lost,
with and without re-planning, on identical fault schedules, measured in one run.

On local CPU ranks (4 by default; the foundation tests' tiny model with 4 micro-batches per
shard), per plan (`--plans`: `dp`, data-parallel over every rank; `pp2`, PP = 2 x DP = W/2) one
fault-free reference run on the launch plan (ordered reduction; every run is audited against
its final state hash and per-iteration hashes, so a re-planned run must match the fixed-plan
reference bit for bit), then per scenario one run per policy:

- scenarios: `medium` and `severe` (rank 3 computes slower from iteration I on, by the factor
  that costs the level's unmitigated throughput loss on this machine: ResiHP §8.3 defines the
  levels by that loss, 55 % and 70 %; see "Severity" below), `slowlink` (rank 3's link: its
  gradient all-reduce stalls, `what=comm,level=medium`), `lost` (device 1 lost for good at
  iteration I), `mixed` (device 1 lost at I, then rank 3's severe slow-down 3 iterations later),
  every slow-down the device's to the end of the run (`until` past the last iteration: it
  stays through the restarts a re-plan may make, [Note: slow-fault]),
  `load` (no fault; one process spins on a core for the whole run: what re-planning costs when
  the detector fires on a loaded machine's noise — issue 18's target is a loss of at most 2 %
  against no mitigation);
- policies (`adapt.policy`, ResiHP §8.1's baselines run live): `ours` (`adapt.enabled`: the
  coordinator re-plans), `none` (no mitigation: the slow rank keeps its micro-batches; a lost
  device fails the job, 0 tokens/s), `evict` (evict-and-restart, Oobleck-like: the slow or lost
  device leaves the job, which restarts from its newest checkpoint on the others with the
  batch spread evenly), `greyhound` (micro-batches redistributed by measured speed, Greyhound's
  `solve_dp`; no answer to a lost device: the job fails). Every run checkpoints every
  `--ckpt-interval` iterations, so evict-and-restart has a checkpoint to go back to and every
  policy pays the same saves.

Per scenario and policy: median tokens/s over the iterations from `I + --settle` on, its ratio
to ours, reconfiguration seconds (a lost device: detection to the first iteration on the
survivors; a slow device: the boundary switch), checkpoint loads, bit-exactness. On a
data-parallel job the scheduler's steps reduce to the micro-batch redistribution Greyhound also
makes (its exclusion step keeps every rank at one micro-batch or more), so `greyhound` is
expected at about ours on the slow scenario; the plans differ where PP or TP can be re-planned,
which live jobs do not yet do.

On the `pp2` plan every scenario and policy runs (`greyhound`: micro-batches moved between
the two replicas by measured speed, one kept on each; `evict`: the slow or lost device out,
one even pipeline on the others from the newest checkpoint). Ours: a lost device dissolves
its replica and the survivors continue in place on the other replica's retained state; around a slow device micro-batches move to the other replica, or, when its own step
bounds the iteration, it leaves the world with its replica; `mixed`'s slow device, a stage
of the one replica left after the loss, is found against its own pace in the world before
and replaced by the dissolved replica's standby, from the newest checkpoint. What ours does
not answer there: a slow link (a plan's ranks fire no all-reduce hooks, so the detector's
link checks are data-parallel only).

On the `tp2` plan (TP = 2 x DP = W/2, `--plans tp2`): a slow device holds its TP peer at
every layer's collective, so its whole replica runs at its pace. Ours may shrink its TP group
to the peer (ResiHP §6.1; the peer computes as the group did, `unbroken.engine.emulate`, so
the run stays bit-exact against the launch plan) and give that replica fewer micro-batches,
at a planned stop with the state moved; `greyhound` moves micro-batches between the replicas;
a lost device dissolves its replica (its TP peer stands by).

Severity. `unbroken.detect.levels` turns a level into a factor assuming the slowed rank's whole
iteration stretches (3.33 for severe). On the shared 2-core VM four ranks oversubscribe two
cores, so a rank that sleeps (the `slow` fault) frees CPU its peers use: factor 4 cost only
~39 % there, a weak slow-down by the paper's measure. So per plan a probe run without
mitigation at `--probe-factor` measures the loss L, the effective stretched share s follows
from L = 1 - 1 / (1 + s (F - 1)), and each level gets the factor that costs its loss at that s
(`--medium-factor` / `--severe-factor` set them instead). The `none` rows then report the loss
the factor really cost (`loss`), next to the level's target.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["add_arguments", "run"]

POLICIES = ("ours", "none", "evict", "greyhound")
ADAPT_POLICY = {"ours": "resihp", "evict": "evict", "greyhound": "greyhound"}
"""bench policy -> `adapt.policy` (`none` runs without `adapt.enabled`)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--iterations", type=int, default=40, help="iterations per run (default 40)")
    p.add_argument("--at", type=int, default=14, help="iteration the fault fires (default 14)")
    p.add_argument("--settle", type=int, default=10, help="iterations after it not measured")
    p.add_argument(
        "--probe-factor",
        type=float,
        default=4.0,
        help="factor of the run that calibrates the severity levels (4; module docstring)",
    )
    p.add_argument("--medium-factor", type=float, default=None, help="(default: calibrated)")
    p.add_argument("--severe-factor", type=float, default=None, help="(default: calibrated)")
    p.add_argument("--world-size", type=int, default=4, help="ranks (default 4)")
    p.add_argument(
        "--layers",
        type=int,
        default=0,
        help="the tiny model's layers (default: the preset's 2; with 4 a pipeline's layers can "
        "move between its stages)",
    )
    p.add_argument(
        "--plans",
        default="dp,pp2",
        help="comma-separated launch plans: dp (DP = W), pp2 (PP = 2 x DP = W/2), tp2 (TP = 2 "
        "x DP = W/2); default dp,pp2",
    )
    p.add_argument(
        "--ckpt-interval", type=int, default=5, help="iterations between checkpoints (default 5)"
    )
    p.add_argument(
        "--policies",
        default=",".join(POLICIES),
        help=f"comma-separated subset of {','.join(POLICIES)} (ours always runs)",
    )
    p.add_argument(
        "--scenarios",
        default=",".join(SCENARIOS),
        help=f"comma-separated subset of {','.join(SCENARIOS)} (default: all)",
    )
    p.add_argument("--out", default=None, help="keep the run dirs here (default: a temp dir)")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")


def _say(text: str) -> None:
    print(f"[adapt] {text}", file=sys.stderr, flush=True)


PLANS = ("dp", "pp2", "tp2")
SCENARIOS = ("medium", "severe", "slowlink", "lost", "mixed", "load")


def _plan_name(args: argparse.Namespace, plan: str) -> str:
    w = args.world_size
    name = {"dp": f"dp{w}", "pp2": f"pp2xdp{w // 2}", "tp2": f"tp2xdp{w // 2}"}[plan]
    return f"{name}-l{args.layers}" if args.layers else name


def _job(args: argparse.Namespace, inject: list[str], policy: str, plan: str = "dp"):
    from unbroken.config import (
        AdaptConfig,
        CheckpointConfig,
        DataConfig,
        JobConfig,
        ModelConfig,
        ParallelConfig,
        RecoveryConfig,
        TrainConfig,
    )

    return JobConfig(
        model=ModelConfig(preset="tiny", **({"n_layers": args.layers} if args.layers else {})),
        data=DataConfig(tokens_per_microbatch=64, microbatches=4, max_documents=200),
        train=TrainConfig(iterations=args.iterations, lr=1e-3),
        parallel=ParallelConfig(
            world_size=args.world_size,
            pp=2 if plan == "pp2" else 1,
            tp=2 if plan == "tp2" else 1,
            reduce="ordered",
        ),
        checkpoint=CheckpointConfig(interval=args.ckpt_interval),
        recovery=RecoveryConfig(heartbeat_interval_s=0.1, heartbeat_timeout_s=1.5),
        adapt=AdaptConfig(enabled=policy != "none", policy=ADAPT_POLICY.get(policy, "resihp")),
        inject=inject,
    )


def _scenarios(args: argparse.Namespace, factors: dict[str, float]) -> dict[str, list[str]]:
    """Each scenario's faults; `factors`: the compute slow-down of each level."""
    # The device's slow-down, not its process's: `until` past the end keeps it on the device
    # through restarts ([Note: slow-fault]), so a device re-admitted on trial is slow again.
    until = args.iterations + 1
    slow = {
        lvl: f"slow:rank=3,iter={args.at},factor={f:.3g},until={until}"
        for lvl, f in factors.items()
    }
    lost = f"lose:rank=1,iter={args.at},phase=update"
    return {
        "medium": [slow["medium"]],
        "severe": [slow["severe"]],
        "slowlink": [f"slow:rank=3,iter={args.at},what=comm,level=medium"],
        "lost": [lost],
        "mixed": [lost, slow["severe"].replace(f"iter={args.at}", f"iter={args.at + 3}")],
        "load": [],
    }


def effective_share(loss: float, factor: float) -> float:
    """The share s of the slowed rank's iteration that factor F stretched, from the loss L it
    cost: L = 1 - 1 / (1 + s (F - 1)) (`unbroken.detect.levels`), clamped to (0.01, 1]."""
    if factor <= 1 or not 0 < loss < 1:
        return 1.0
    return min(1.0, max(0.01, (1 / (1 - loss) - 1) / (factor - 1)))


def level_factors(args: argparse.Namespace, share: float) -> dict[str, float]:
    """medium and severe factors at the measured share, unless given."""
    from unbroken.detect.levels import slow_factor_for

    given = {"medium": args.medium_factor, "severe": args.severe_factor}
    return {lvl: f if f is not None else slow_factor_for(lvl, share) for lvl, f in given.items()}


# Long: one row's fields, each computed where it is named.
def _row(
    args: argparse.Namespace,
    scenario: str,
    policy: str,
    s: dict[str, Any],
    ref: dict[str, Any],
    plan: str = "dp",
) -> dict[str, Any]:
    from unbroken.metrics.summary import audit

    start = args.at + args.settle
    rows = {m["iter"]: m for m in s["metrics"]}
    after = [rows[i]["tokens_per_s"] for i in sorted(rows) if i >= start]
    summary = s["summary"]
    replans = summary.get("replans", [])
    reconfig = None
    if replans:
        reconfig = replans[0].get("reconfig_s") or replans[0].get("switch_s")
    done = summary["state"] == "done"
    return {
        "scenario": scenario,
        "plan": _plan_name(args, plan),
        "policy": policy,
        "tokens_per_s": statistics.median(after) if after and done else 0.0,
        "reconfig_s": reconfig,
        "replans": len(replans),
        "replanned": "; ".join(_what(r) for r in replans),
        "ckpt_loads": sum(e["kind"] == "checkpoint_loaded" for e in s["events"]),
        "bit_exact": audit(ref, s)["bit_exact"] if done else False,
        "state": summary["state"],
    }


def _what(replan: dict[str, Any]) -> str:
    """One re-plan in a few words: how it ran, micro-batches (and TP degrees) after it."""
    tp = f" tp {replan['tp_after']}" if "tp_after" in replan else ""
    return f"{replan.get('restore') or 'live'} {replan['counts_after']}{tp}"


def _one(
    args, root: Path, name: str, inject: list[str], policy: str, plan: str = "dp"
) -> dict[str, Any]:
    from unbroken.api import run_job
    from unbroken.metrics.log import read_jsonl

    out = root / name
    summary = run_job(_job(args, inject, policy, plan), out, quiet=True)
    metrics = [m for m in read_jsonl(out / "metrics.jsonl") if m["run"] == "train"]
    events = [e for e in read_jsonl(out / "events.jsonl") if e["run"] == "train"]
    done = next((e for e in reversed(events) if e["kind"] == "trainer_done"), {})
    return {
        "summary": summary,
        "metrics": metrics,
        "events": events,
        "final_state_hash": summary["final_state_hash"],
        "rank_hashes": done.get("rank_hashes"),
    }


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; print a table (or the rows as JSON). Returns the exit status."""
    root = Path(args.out or tempfile.mkdtemp(prefix="unbroken-adapt-"))
    t0 = time.time()
    policies = _policies(args.policies)
    rows, ref_tps, calibration = [], {}, {}
    wanted = _names(args.scenarios, SCENARIOS, "--scenarios")
    for plan in _plans(args.plans):
        name = _plan_name(args, plan)
        reference = _one(args, root, f"{name}-reference", [], "none", plan)
        ref_tps[name] = _tokens_after(args, reference)
        _say(f"{name} reference: {ref_tps[name]:.0f} tokens/s")
        calibration[name] = _calibrate(args, root, plan, ref_tps[name])
        for scenario, faults in _scenarios(args, calibration[name]["factors"]).items():
            if scenario not in wanted:
                continue
            for policy in policies:
                with _background_load(scenario == "load"):
                    s = _one(args, root, f"{name}-{scenario}-{policy}", faults, policy, plan)
                row = _row(args, scenario, policy, s, reference, plan)
                row["loss"] = 1 - row["tokens_per_s"] / ref_tps[name]
                rows.append(row)
                _say(f"{name} {scenario}/{policy}: {row}")
    _ratios(rows)
    if args.json:
        out = {
            "rows": rows,
            "reference_tokens_per_s": ref_tps,
            "calibration": calibration,
            "load": _load_line(rows),
            "seconds": time.time() - t0,
        }
        print(json.dumps(out, indent=1))
        return 0
    _print_table(rows, ref_tps, args.at + args.settle, calibration)
    if (line := _load_line(rows)) is not None:
        print(line)
    print(f"\n{time.time() - t0:.0f} s; runs in {root}")
    return 0


def _tokens_after(args: argparse.Namespace, s: dict[str, Any]) -> float:
    start = args.at + args.settle
    return statistics.median(m["tokens_per_s"] for m in s["metrics"] if m["iter"] >= start)


def _calibrate(args: argparse.Namespace, root: Path, plan: str, ref_tps: float) -> dict[str, Any]:
    """The severity levels' factors for this plan on this machine (module docstring):
    {"probe_factor", "probe_loss", "share", "factors"}; no probe run when both are given."""
    name = _plan_name(args, plan)
    if args.medium_factor is not None and args.severe_factor is not None:
        return {"probe_factor": None, "probe_loss": None, "share": None,
                "factors": level_factors(args, 1.0)}  # fmt: skip
    probe = f"slow:rank=3,iter={args.at},factor={args.probe_factor:g}"
    s = _one(args, root, f"{name}-probe-none", [probe], "none", plan)
    loss = 1 - _tokens_after(args, s) / ref_tps
    share = effective_share(loss, args.probe_factor)
    factors = level_factors(args, share)
    _say(
        f"{name} probe: factor {args.probe_factor:g} cost {loss:.0%} without mitigation "
        f"(stretched share {share:.2f}); medium factor {factors['medium']:.2f}, severe "
        f"{factors['severe']:.2f}"
    )
    return {"probe_factor": args.probe_factor, "probe_loss": loss, "share": share,
            "factors": factors}  # fmt: skip


def _ratios(rows: list[dict[str, Any]]) -> None:
    """Each row's tokens/s over ours' (same plan and scenario)."""
    for row in rows:
        ours = next(
            r
            for r in rows
            if (r["plan"], r["scenario"], r["policy"]) == (row["plan"], row["scenario"], "ours")
        )
        row["ratio_to_ours"] = (
            row["tokens_per_s"] / ours["tokens_per_s"] if ours["tokens_per_s"] else None
        )


@contextlib.contextmanager
def _background_load(on: bool) -> Iterator[None]:
    """The `load` scenario's background work: one process spinning for the whole run."""
    if not on:
        yield
        return
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        spin.kill()
        spin.wait()


def _load_line(rows: list[dict[str, Any]]) -> str | None:
    """The `load` scenario in one line, a clause per plan (`_plan_load`)."""
    lines = []
    for plan in dict.fromkeys(r["plan"] for r in rows):
        line = _plan_load([r for r in rows if r["plan"] == plan])
        if line is not None:
            lines.append(f"{plan}: {line}")
    return "; ".join(lines) or None


def _plan_load(rows: list[dict[str, Any]]) -> str | None:
    """One plan's `load` scenario: ours' re-plans and its tokens/s against none."""
    load = {r["policy"]: r for r in rows if r["scenario"] == "load"}
    if "ours" not in load or "none" not in load or not load["none"]["tokens_per_s"]:
        return None
    loss = 1 - load["ours"]["tokens_per_s"] / load["none"]["tokens_per_s"]
    if not load["ours"]["replans"]:
        # Both runs are then the same job (the ordered reduction in both): what differs is the
        # background load's share of the cores, run to run, not a cost of re-planning.
        return (
            "under background load, no fault: ours re-planned 0 times, so re-planning cost "
            f"nothing; its tokens/s differ from no mitigation's by {-loss:+.1%} (run-to-run "
            "noise of the load)"
        )
    return (
        f"under background load, no fault: ours re-planned {load['ours']['replans']} time(s), "
        f"tokens/s {loss:+.1%} lower than no mitigation (target <= 2 %)"
    )


def _plans(text: str) -> list[str]:
    """`--plans`: known names, in the order given."""
    return _names(text, PLANS, "--plans")


def _names(text: str, known: tuple[str, ...], flag: str) -> list[str]:
    """A comma-separated list of `known` names, in the order given (at least one)."""
    from unbroken.errors import UserError

    names = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in names if p not in known]
    if unknown or not names:
        raise UserError(f"{flag}: unknown {', '.join(unknown)} (known: {', '.join(known)})")
    return names


def _policies(text: str) -> list[str]:
    """`--policies`: known names, ours first and always."""
    from unbroken.errors import UserError

    names = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in names if p not in POLICIES]
    if unknown:
        raise UserError(f"--policies: unknown {', '.join(unknown)} (known: {', '.join(POLICIES)})")
    return ["ours", *[p for p in POLICIES if p in names and p != "ours"]]


def _print_table(
    rows: list[dict[str, Any]],
    ref_tps: dict[str, float],
    start: int,
    calibration: dict[str, dict[str, Any]],
) -> None:
    refs = ", ".join(f"{plan} {tps:.0f}" for plan, tps in ref_tps.items())
    print(f"fault-free references (tokens/s, iterations >= {start}): {refs}")
    for plan, c in calibration.items():
        f = c["factors"]
        probe = (
            f"probe factor {c['probe_factor']:g} cost {c['probe_loss']:.0%} unmitigated "
            f"(stretched share {c['share']:.2f}); "
            if c["probe_factor"] is not None
            else ""
        )
        print(f"{plan}: {probe}medium factor {f['medium']:.2f}, severe {f['severe']:.2f}")
    print(
        f"{'plan':10}{'scenario':10}{'policy':10}{'tokens/s':>10}{'loss':>7}{'vs ours':>9}"
        f"{'reconfig s':>12}{'ckpt loads':>12}{'bit-exact':>11}  re-plans"
    )
    for r in rows:
        ratio = f"{r['ratio_to_ours']:.2f}" if r["ratio_to_ours"] is not None else "-"
        reconfig = f"{r['reconfig_s']:.2f}" if r["reconfig_s"] is not None else "-"
        print(
            f"{r['plan']:10}{r['scenario']:10}{r['policy']:10}{r['tokens_per_s']:>10.0f}"
            f"{r['loss']:>7.0%}{ratio:>9}{reconfig:>12}{r['ckpt_loads']:>12}"
            f"{r['bit_exact']!s:>11}  {r['replanned'] or '-'}"
        )
    print(
        "loss: tokens/s below the plan's fault-free reference (ResiHP's levels: medium 55 %, "
        "severe 70 % unmitigated)"
    )
