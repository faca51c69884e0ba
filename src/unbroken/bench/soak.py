"""Soak (issue 21): the demo job trained for `--minutes` through a failure every 10-30 s — nothing
leaks, nothing diverges, throughput does not decay.

The demo's job (`unbroken.config.demo.demo_config`: the small model on 4 local CPU ranks,
in-place recovery with shadows) with its own schedule of failures drawn from a seed it prints
(`unbroken.bench.soak_schedule`: every kind the runtime injects here — kill, hang, exception,
page loss within and beyond tolerance, corrupt checkpoint, memory spike, slow, and on more
than one node a lost device and a lost node). By default the ranks run on two local hosts
(`--nodes 2`): node 1's agent is its own process from 127.0.0.2, the job re-plans around what
it loses, and `unbroken.bench.soak_nodes.NodeKeeper` brings node 1 back after each loss with
its hardware replaced, so the job grows back to its launch world. `--device cuda` runs the
same job on this machine's GPUs instead (one rank per GPU, bf16, one host) and adds the GPUs'
memory in use to what is watched and checked.

How long: the schedule is made of iteration triggers, so the job's length is an iteration
count. A short fault-free calibration run of the same job measures the steady iteration time
(`--iter-s` skips it), and the schedule turns `--minutes` of wall time into iterations with it
and an estimate of each failure's cost. The faulty run lasts about `--minutes`; the fault-free
reference of the same iterations (`run_job(reference=True)`, which also audits the final
state, every rank's state and every hashed iteration bit for bit) runs before it and costs up
to as long again, without protection.

What it watches (`unbroken.bench.soak_watch`, a thread of this process, outside the runtime):
every `--interval` s, per class of the job's processes, their count, open fds, memfds, RSS and
shared memory, the event log's size and the recoveries so far, into OUT/soak.jsonl.

What it asserts (`unbroken.bench.soak_checks`, [Note: soak bounds]): bit-exact against the
reference; every scheduled fault fired and every failure detected and recovered; per class and
resource a slope per recovery under its bound; no zombie piling up; no process of the job left
after it ended; steady iteration time and detection + restart time in the last tenth of the run no more
than `--iter-tolerance` / `--recovery-tolerance` above the first tenth. A PASS/FAIL line per
check; exit status 0 only if all pass.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from unbroken.bench.soak_checks import (
    Check,
    coordinator_checks,
    cpu_ends,
    ends_ratio,
    fit_slope,
    leak_checks,
    recompute_s,
    recovery_ratio,
    restart_s,
    stats_points,
    steady_iterations,
    with_recoveries,
)
from unbroken.bench.soak_nodes import NodeKeeper
from unbroken.bench.soak_schedule import ScheduledFault, draw_schedule
from unbroken.bench.soak_watch import CLASSES, GpuProbe, ResourceSampler, alive, descendants

__all__ = ["add_arguments", "run", "soak"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--minutes", type=float, default=60.0, help="faulty run's length (default 60)")
    p.add_argument("--seed", type=int, default=None, help="seed of the schedule (default: drawn)")
    p.add_argument("--out", default="runs/soak", help="output dir (default runs/soak)")
    p.add_argument("--json", action="store_true", help="print the result (checks, rows) as JSON")
    p.add_argument(
        "--iter-s", type=float, default=None, help="iteration time (default: measured first)"
    )
    p.add_argument(
        "--nodes",
        type=int,
        default=None,
        help="local hosts the 4 ranks run on (default 2 on cpu: lost devices and nodes are "
        "drawn too; 1 on cuda)",
    )
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu: 4 local CPU ranks (default); cuda: one rank per GPU of this machine, "
        "with the GPUs' memory in the leak checks",
    )
    p.add_argument("--interval", type=float, default=2.0, help="seconds between samples (2)")
    p.add_argument("--settle", type=int, default=5, help="iterations after a failure not steady")
    p.add_argument(
        "--iter-tolerance", type=float, default=0.10, help="steady iteration time decay (0.10)"
    )
    p.add_argument(
        "--recovery-tolerance",
        type=float,
        default=0.10,
        help="decay of detection + restart time per kind (0.10)",
    )


LEAK_GROUPS = {
    "coordinator": ("coordinator",),
    "agent": ("agent",),
    "state_manager": ("state_manager",),
    "trainer+shadow": ("trainer", "shadow"),
    "zombie": ("zombie",),
    "all": CLASSES,
}
"""The process classes whose resources are fitted together ([Note: soak bounds])."""


def _say(text: str) -> None:
    print(f"[soak] {text}", file=sys.stderr, flush=True)


def soak_config(iterations: int, inject: list[str], restarts: int, nodes: int = 1, gpus: int = 0):
    """The demo job with the soak's length and failures. On more than one node it re-plans
    (`adapt.enabled`: a lost device or node is planned around, a returned node grown back),
    with no cap on re-plans: the soak slows a rank down every few minutes on purpose, and a
    capped job would keep the last re-plan's placement for the rest of the run. With `gpus`
    it trains on this machine's GPUs instead, one rank each (NCCL allows one rank per GPU), in
    bf16 like `unbroken bench gpu`'s jobs."""
    from unbroken.config import NodesConfig, ParallelConfig
    from unbroken.config.demo import demo_config

    cfg = demo_config(quick=False)
    if gpus:
        cfg = dataclasses.replace(
            cfg,
            parallel=ParallelConfig(world_size=gpus),
            train=dataclasses.replace(cfg.train, device="cuda", precision="bf16"),
        )
    if nodes > 1:
        cfg = dataclasses.replace(
            cfg,
            nodes=NodesConfig(count=nodes),
            adapt=dataclasses.replace(cfg.adapt, enabled=True, max_replans=10 * restarts),
        )
    return dataclasses.replace(
        cfg,
        train=dataclasses.replace(cfg.train, iterations=iterations),
        recovery=dataclasses.replace(cfg.recovery, max_restarts=restarts),
        inject=inject,
    )


def measure_iter_s(out: Path, gpus: int = 0) -> float:
    """The fault-free job's steady iteration time (median of iterations 4-11, checkpoint time
    excluded), from a 12-iteration run."""
    from unbroken.api import run_job
    from unbroken.metrics.log import read_jsonl

    run_job(soak_config(12, [], 20, gpus=gpus), out, quiet=True)
    rows = [m for m in read_jsonl(out / "metrics.jsonl") if m["run"] == "train" and m["iter"] >= 4]
    return statistics.median(m["iter_s"] - (m.get("ckpt_s") or 0.0) for m in rows)


def plan_soak(minutes: float, seed: int, iter_s: float, nodes: int = 1, gpus: int = 0):
    """(the failures, the job's iterations, the job's config) of a soak."""
    demo = soak_config(1, [], 1, gpus=gpus)
    faults, iterations = draw_schedule(
        seed,
        minutes * 60,
        iter_s,
        demo.parallel.world_size,
        demo.protection.resolved(gpus > 0).parity_pages,
        nodes=nodes,
    )
    restarts = sum(f.failstop for f in faults) + 10
    cfg = soak_config(iterations, [f.spec for f in faults], restarts, nodes, gpus)
    return faults, iterations, cfg


def _wait_orphans(timeout_s: float = 30.0) -> list[int]:
    """Processes below this one still alive (not zombies) `timeout_s` after the job ended."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = [p for p in descendants(os.getpid()) if alive(p)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


def soak(
    minutes: float,
    seed: int,
    out: Path,
    *,
    iter_s: float | None = None,
    nodes: int = 2,
    interval_s: float = 2.0,
    settle: int = 5,
    iter_tolerance: float = 0.10,
    recovery_tolerance: float = 0.10,
    gpus: int = 0,
) -> dict[str, Any]:
    """Run the soak; returns its result (`checks`, `passed`, figures). See the module docstring.

    Args:
        minutes: the faulty run's target length.
        seed: seeds the failure schedule.
        out: output dir: `calibrate/`, `job/` (the runs), `soak.jsonl`, `soak-result.json`.
        iter_s: the iteration time to plan with (None: measured by a calibration run).
        nodes: local hosts of the job (`unbroken.bench.soak_nodes`); with more than one, the
            schedule loses devices and nodes of the last one, which comes back each time.
        interval_s: seconds between resource samples.
        settle: iterations after a failure whose time is not steady.
        iter_tolerance: largest relative rise of the steady iteration time, first to last tenth.
        recovery_tolerance: the same for the normalized detection + restart time.
        gpus: train on this machine's first `gpus` GPUs, one rank each (0: 4 CPU ranks), and
            watch their memory.
    """
    from unbroken.metrics.log import read_jsonl

    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    iter_s, faults, iterations, cfg = _calibrated_plan(out, minutes, seed, iter_s, nodes, gpus)
    summary, samples, orphans, returns = _watched_run(cfg, out, interval_s, minutes)
    metrics = [m for m in read_jsonl(out / "job" / "metrics.jsonl") if m["run"] == "faulty"]
    events = [e for e in read_jsonl(out / "job" / "events.jsonl") if e["run"] == "faulty"]
    result = _result(
        summary.to_dict(),
        samples,
        metrics,
        faults,
        orphans,
        settle=settle,
        tolerances=(iter_tolerance, recovery_tolerance),
        stats=with_recoveries(events),
        world=cfg.parallel.world_size,
        returns=(len(returns), _node_returns(events)),
    )
    result.update(
        seed=seed,
        minutes=minutes,
        iter_s_planned=iter_s,
        iterations=iterations,
        schedule=[f.spec for f in faults],
        seconds=round(time.time() - t0, 1),
        faulty_wall_s=summary.faulty_wall_s,
        run_dir=str(out / "job"),
    )
    (out / "soak-result.json").write_text(json.dumps(result, indent=1))
    return result


def _calibrated_plan(
    out: Path, minutes: float, seed: int, iter_s: float | None, nodes: int, gpus: int
):
    """(iteration time, failures, iterations, config): `plan_soak` with the iteration time
    measured first (OUT/calibrate) unless given."""
    if iter_s is None:
        iter_s = measure_iter_s(out / "calibrate", gpus)
        _say(f"calibration: {iter_s:.3f} s per iteration")
    faults, iterations, cfg = plan_soak(minutes, seed, iter_s, nodes, gpus)
    where = f"{gpus} GPU(s)" if gpus else f"{nodes} node(s)"
    _say(
        f"seed {seed}: {len(faults)} faults over {iterations} iterations ({minutes:g} min, {where})"
    )
    return iter_s, faults, iterations, cfg


def _watched_run(cfg, out: Path, interval_s: float, minutes: float):
    """Run the job and its reference in OUT/job with the sampler watching (and, on more than
    one node, the other nodes' agents: `NodeKeeper`); (summary, samples, processes left after
    it ended, the kept node's returns)."""
    from unbroken.api import run_job

    samples_path = out / "soak.jsonl"
    samples_path.unlink(missing_ok=True)
    job_dir = out / "job"
    job_dir.mkdir(parents=True, exist_ok=True)
    (job_dir / "events.jsonl").unlink(missing_ok=True)  # the sampler must not read a stale run
    gpu = GpuProbe() if cfg.train.device == "cuda" else None
    world = cfg.parallel.world_size
    sampler = ResourceSampler(job_dir, samples_path, interval_s, world=world, gpu=gpu)
    sampler.start()
    run = dict(reference=True, quiet=True, source="unbroken bench soak")
    try:
        if cfg.nodes.count == 1:
            summary, returns = run_job(cfg, job_dir, **run), []
        else:
            # The first agents wait through the fault-free reference (up to the faulty run's
            # length again, without protection) for the faulty run's coordinator.
            keeper = NodeKeeper(
                cfg.nodes.count,
                cfg.nodes.per_node(cfg.parallel.world_size),
                job_dir / "devices" / "faulty",
                connect_timeout_s=minutes * 60 * 3 + 600,
            )
            with keeper:
                summary = run_job(cfg, job_dir, join=keeper.join, secret=keeper.secret, **run)
            returns = keeper.restarts
    finally:
        sampler.stop()
        if gpu is not None:
            gpu.close()
    return summary, sampler.rows, _wait_orphans(), returns


def _node_returns(events: list[dict[str, Any]]) -> int:
    return sum(e["kind"] == "node_returned" for e in events)


def _result(
    summary: dict[str, Any],
    samples: list[dict[str, Any]],
    metrics: list[dict[str, Any]],
    faults: list[ScheduledFault],
    orphans: list[int],
    *,
    settle: int,
    tolerances: tuple[float, float],
    stats: list[dict[str, Any]] = (),
    world: int = 4,
    returns: tuple[int, int] = (0, 0),
) -> dict[str, Any]:
    """Every check and the figures behind them. `returns`: (times the kept node was started
    again, `node_returned` events of the run)."""
    failstop = sum(f.failstop for f in faults)
    recoveries = summary["recoveries"]
    failures = [(f.iteration, f.kind) for f in faults]
    steady = steady_iterations(metrics, failures, settle, world)
    checks = _job_checks(summary, failstop, orphans) + _return_checks(faults, returns)
    checks += leak_checks(samples, LEAK_GROUPS)
    checks.append(_ends_check("steady iteration time", [s for _, s in steady], tolerances[0]))
    checks.append(
        _ends_check(
            "recovery time, detect + restart (per kind)", recovery_ratio(recoveries), tolerances[1]
        )
    )
    recompute = ends_ratio(recovery_ratio(recoveries, recompute_s))
    events = [(s["recoveries"], s["events_bytes"] / 1024) for s in samples]
    checks += coordinator_checks(stats)
    return {
        "passed": all(c.passed for c in checks),
        "checks": [c.as_dict() for c in checks],
        "failures_scheduled": len(faults),
        "failstop_scheduled": failstop,
        "recoveries": [{k: r.get(k) for k in _RECOVERY_KEYS} for r in recoveries],
        "detect_s_median": _median([r["detect_s"] for r in recoveries]),
        "total_s_median": _median([r["total_s"] for r in recoveries]),
        "restart_s_median": _median([restart_s(r) for r in recoveries]),
        "recompute_ratio_ends": recompute,
        "steady_iterations": len(steady),
        "steady_iter_s_median": _median([s for _, s in steady]),
        "cpu_cores_ends": cpu_ends(samples),
        "events_kib_per_recovery": fit_slope(events) if len(events) > 1 else None,
        "coordinator_stats": len(stats),
        "store_keys": [(r, k) for r, k, _ in stats_points(stats)],
        "samples": len(samples),
        "first_sample": samples[0] if samples else None,
        "last_sample": samples[-1] if samples else None,
    }


_RECOVERY_KEYS = (
    "fault", "mode", "rank", "iteration", "phase", "detect_s", "init_s", "recompute_s", "total_s"
)  # fmt: skip


def _return_checks(faults: list[ScheduledFault], returns: tuple[int, int]) -> list[Check]:
    """Every lost node came back (none when no node was lost)."""
    lost_nodes = sum(f.kind == "nodeloss" for f in faults)
    if not lost_nodes:
        return []
    started, returned = returns
    return [
        Check(
            "every lost node returned",
            started == returned == lost_nodes,
            f"{returned}/{lost_nodes}",
            lost_nodes,
            f"agent started again {started} times, node_returned {returned} times",
        )
    ]


def _job_checks(summary: dict[str, Any], failstop: int, orphans: list[int]) -> list[Check]:
    """Exactness, completion, recovery of every failure, no process left."""
    exact = summary.get("bit_exact")
    return [
        Check("bit-exact vs reference", exact is True, exact, True),
        Check(
            "job done, every fault fired",
            summary["state"] == "done" and not summary["faults_not_fired"],
            summary["state"],
            "done",
            f"not fired: {list(summary['faults_not_fired'])}",
        ),
        Check(
            "every failure recovered",
            summary["failures_recovered"] == summary["failures_detected"] >= failstop,
            f"{summary['failures_recovered']}/{summary['failures_detected']}",
            f">={failstop}",
            "recovered/detected vs fail-stop faults scheduled",
        ),
        Check("no process left after the job", not orphans, len(orphans), 0, str(orphans)),
    ]


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _ends_check(name: str, values: list[float], tolerance: float) -> Check:
    ends = ends_ratio(values)
    if ends is None or ends[2] is None:
        return Check(name, None, "-", f"<={1 + tolerance:.2f}", f"too few ({len(values)})")
    first, last, ratio = ends
    return Check(
        name,
        ratio <= 1 + tolerance,
        round(ratio, 3),
        f"<={1 + tolerance:.2f}",
        f"first tenth {first:.3f}, last tenth {last:.3f} (of {len(values)})",
    )


def _gpus(device: str, nodes: int | None) -> int:
    """The GPUs a `--device cuda` soak trains on (every one of this machine); 0 on cpu.

    Raises:
        UserError: cuda without a GPU, or with `--nodes` other than 1.
    """
    from unbroken.errors import UserError

    if device != "cuda":
        return 0
    if nodes not in (None, 1):
        raise UserError("--device cuda: one host (--nodes 1); its GPUs are the job's ranks")
    import torch

    count = torch.cuda.device_count()
    if count == 0:
        raise UserError("--device cuda: torch sees no CUDA device on this machine")
    return count


def run(args: argparse.Namespace) -> int:
    """Run the soak; print a PASS/FAIL line per check (or the result as JSON)."""
    from unbroken.errors import UserError

    if args.minutes <= 0 or args.interval <= 0 or (args.iter_s is not None and args.iter_s <= 0):
        raise UserError("--minutes, --interval and --iter-s must be positive")
    gpus = _gpus(args.device, args.nodes)
    nodes = args.nodes or (1 if gpus else 2)
    if nodes not in (1, 2, 4):
        raise UserError("--nodes: 1, 2 or 4 (the demo's 4 ranks split evenly over the nodes)")
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 31)
    _say(f"seed {seed} (repeat with --seed {seed})")
    result = soak(
        args.minutes,
        seed,
        Path(args.out),
        iter_s=args.iter_s,
        nodes=nodes,
        interval_s=args.interval,
        settle=args.settle,
        iter_tolerance=args.iter_tolerance,
        recovery_tolerance=args.recovery_tolerance,
        gpus=gpus,
    )
    lines = [
        Check(c["check"], c["passed"], c["value"], c["bound"], c["detail"]).line()
        for c in result["checks"]
    ]
    if args.json:  # the verdicts still go to the terminal, the rows to stdout
        print("\n".join(lines), file=sys.stderr)
        print(json.dumps(result, indent=1))
    else:
        print("\n".join(lines))
        print(
            f"\nseed {seed}: {result['failures_scheduled']} faults, {result['iterations']} "
            f"iterations, {len(result['recoveries'])} recoveries (median detect "
            f"{result['detect_s_median']} s, total {result['total_s_median']} s); "
            f"{result['seconds']:.0f} s; samples in {args.out}/soak.jsonl"
        )
        cpu = ", ".join(f"{c} {a:.2f}->{b:.2f}" for c, (a, b) in result["cpu_cores_ends"].items())
        print(f"cores used per class, first -> last tenth (steady samples): {cpu or '-'}")
        first, last = result["first_sample"] or {}, result["last_sample"] or {}
        if "gpu" in last:
            print(
                f"GPU memory in use, first -> last sample: {first['gpu']['used_mib']:.0f} -> "
                f"{last['gpu']['used_mib']:.0f} MiB"
            )
        print("PASS" if result["passed"] else "FAIL")
    return 0 if result["passed"] else 1
