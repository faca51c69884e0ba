"""Recovery benchmark: protection overhead and per-failure recovery time, in-place vs
checkpoint-restart, on identical failure schedules, measured in one run.

On the demo model with 4 CPU ranks (configurable):
  1. steady-state iteration time with in-place protection (RMU: gradient parity, chunk
     transactions, marker) vs without it, fault-free, checkpoints off in both, runs alternated;
  2. the same failure schedule (crashes inside the update, in the backward pass, during the parity
     update, and one crash with lost retained pages) recovered by checkpoint-restart, in place
     with restarted processes, and in place through shadow trainers pre-initialized to L1, L2
     and L3: detection, initialization, recomputation and total per failure (Leto §8.1), plus
     the localization and reconstruction times of the in-place repairs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from unbroken.config import JobConfig

__all__ = ["add_arguments", "run"]

# Phases every updater has (the plain updater has no parity/write-back steps), so both recovery
# modes see the same failures at the same points. Checkpoint-restart has no retained pages to
# lose: there the page-loss failure is the same SIGKILL without the holes.
SCHEDULE = (
    "kill:rank=1,iter={a},phase=update",
    "kill:rank=2,iter={b},phase=backward",
    "pageloss:rank=3,iter={c},phase=update,pages=2,parity=1",
    "kill:rank=0,iter={d},phase=forward",
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--iterations", type=int, default=100, help="iterations per run (default 100)")
    p.add_argument("--repeats", type=int, default=2, help="fault-free runs per variant")
    p.add_argument("--world-size", type=int, default=4, help="ranks (default 4)")
    p.add_argument("--out", default=None, help="keep the run dirs here (default: a temp dir)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _median_iter(metrics: list[dict[str, Any]], skip: int = 3) -> float:
    times = [m["iter_s"] for m in metrics if m["iter"] >= skip and not m.get("ckpt_s")]
    return statistics.median(times)


def _say(text: str) -> None:
    print(f"[recovery] {text}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; print a table (or one JSON object). Returns the exit status."""
    from unbroken.config import ParallelConfig
    from unbroken.config.demo import demo_config

    base = demo_config(quick=False)
    base = dataclasses.replace(
        base,
        train=dataclasses.replace(base.train, iterations=args.iterations),
        parallel=ParallelConfig(world_size=args.world_size),
        inject=[],
    )
    root = Path(args.out or tempfile.mkdtemp(prefix="unbroken-recovery-"))
    t0 = time.time()
    plain_s, protected_s = _steady_runs(base, root, args.repeats)
    overhead = statistics.median(protected_s) / statistics.median(plain_s) - 1.0
    out = {
        "overhead_pct": 100.0 * overhead,
        "steady_iter_s": {"plain": plain_s, "rmu": protected_s},
        **_faulty_runs(base, root, args.iterations),
        "world_size": args.world_size,
        "iterations": args.iterations,
        "seconds": time.time() - t0,
    }
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    _print_report(out)
    return 0


def _variant(
    base: JobConfig, mode: str, checkpoints: bool, inject: list[str], shadow: int = 0
) -> JobConfig:
    """`base` recovering by `mode` (with `shadow`-level shadows), checkpoints on or off, and
    the faults `inject`."""
    return dataclasses.replace(
        base,
        recovery=dataclasses.replace(base.recovery, mode=mode, shadow_level=shadow),
        checkpoint=dataclasses.replace(base.checkpoint, enabled=checkpoints),
        inject=inject,
    )


def _steady_runs(base: JobConfig, root: Path, repeats: int) -> tuple[list[float], list[float]]:
    """1. Steady-state median iteration without and with in-place protection, fault-free,
    checkpoints off, the two variants alternated `repeats` times."""
    from unbroken.api import run_job
    from unbroken.metrics.log import read_jsonl

    plain_s: list[float] = []
    protected_s: list[float] = []
    for r in range(repeats):
        for name, mode, sink in (
            ("plain", "ckpt_restart", plain_s),
            ("rmu", "inplace", protected_s),
        ):
            out = root / f"steady-{name}-{r}"
            run_job(_variant(base, mode, False, []), out, quiet=True)
            metrics = read_jsonl(out / "metrics.jsonl")
            sink.append(_median_iter(metrics))
            _say(f"steady {name} #{r}: median iteration {sink[-1] * 1e3:.1f} ms")
    return plain_s, protected_s


VARIANTS = {
    "ckpt_restart": ("ckpt_restart", 0),
    "inplace": ("inplace", 0),
    "L1": ("inplace", 1),
    "L2": ("inplace", 2),
    "L3": ("inplace", 3),
}
"""Name -> (recovery mode, shadow level) of the runs under the failure schedule."""


def _faulty_runs(base: JobConfig, root: Path, n: int) -> dict[str, Any]:
    """2. One failure schedule over `n` iterations, recovered by every one of `VARIANTS`:
    median recovery times, speedups, repair times, each run's recoveries and exactness."""
    from unbroken.api import run_job
    from unbroken.metrics.log import read_jsonl

    marks = dict(a=n // 5, b=2 * n // 5, c=3 * n // 5, d=4 * n // 5)
    schedule = [f.format(**marks) for f in SCHEDULE]
    results: dict[str, dict[str, Any]] = {}
    for name, (mode, shadow) in VARIANTS.items():
        out = root / f"faulty-{name}"
        faults = schedule
        if mode == "ckpt_restart":
            faults = [f.split(",pages")[0].replace("pageloss:", "kill:") for f in schedule]
        s = run_job(_variant(base, mode, True, faults, shadow), out, reference=False, quiet=True)
        totals = [r["total_s"] for r in s["recoveries"]]
        results[name] = {"summary": s, "totals": totals, "dir": out}
        _say(f"{name}: recoveries {[round(t, 2) for t in totals]} s")
    repairs = [
        e
        for e in read_jsonl(results["inplace"]["dir"] / "events.jsonl")
        if e["kind"] == "inplace_repair" and e["lost_pages"]
    ]
    inplace_med = statistics.median(results["inplace"]["totals"])
    ckpt_med = statistics.median(results["ckpt_restart"]["totals"])
    shadow_med = {lv: statistics.median(results[lv]["totals"]) for lv in ("L1", "L2", "L3")}
    return {
        "inplace_recovery_s": inplace_med,
        "ckpt_restart_recovery_s": ckpt_med,
        "speedup": ckpt_med / inplace_med,
        "shadow_recovery_s": shadow_med,
        "speedup_l3": ckpt_med / shadow_med["L3"],
        "localize_ms": statistics.median(e["localize_ms"] for e in repairs) if repairs else None,
        "reconstruct_ms": (
            statistics.median(e["reconstruct_ms"] for e in repairs) if repairs else None
        ),
        "schedule": schedule,
        "recoveries": {name: results[name]["summary"]["recoveries"] for name in VARIANTS},
        "exact": {
            name: results[name]["summary"]["final_state_hash"]
            == results["ckpt_restart"]["summary"]["final_state_hash"]
            for name in VARIANTS
        },
    }


def _print_report(out: dict[str, Any]) -> None:
    plain_s, protected_s = out["steady_iter_s"]["plain"], out["steady_iter_s"]["rmu"]
    inplace_med, ckpt_med = out["inplace_recovery_s"], out["ckpt_restart_recovery_s"]
    print(
        f"protection overhead      {out['overhead_pct']:6.2f} %  (median iteration, "
        f"{statistics.median(protected_s) * 1e3:.1f} vs {statistics.median(plain_s) * 1e3:.1f} ms)"
    )
    print(
        f"in-place recovery        {inplace_med:6.2f} s   (median of {len(out['recoveries']['inplace'])})"
    )
    print(f"checkpoint-restart       {ckpt_med:6.2f} s")
    print(f"speedup                  {out['speedup']:6.2f} x")
    for lv, sec in out["shadow_recovery_s"].items():
        print(f"in-place, {lv} shadows      {sec:6.2f} s")
    print(f"speedup with L3 shadows  {out['speedup_l3']:6.2f} x")
    if out["localize_ms"] is not None:
        print(
            f"localize / reconstruct   {out['localize_ms']:.2f} ms / {out['reconstruct_ms']:.2f} ms"
        )
    print(f"{'failure':44}{'mode':>14}{'detect':>8}{'init':>8}{'recomp':>8}{'total':>8}")
    for mode in ("inplace", "ckpt_restart"):
        for r in out["recoveries"][mode]:
            what = f"{r['kind']} r{r['rank']} it{r['iteration']} {r['phase']}"
            print(
                f"{what:44}{mode:>14}{r['detect_s']:8.3f}{r['init_s']:8.2f}"
                f"{r['recompute_s']:8.2f}{r['total_s']:8.2f}"
            )
