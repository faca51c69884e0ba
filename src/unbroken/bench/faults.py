"""Fault-injection campaign: random hardware-operable failures (and page losses) at random
(rank, iteration, phase); every recovered run must end bit-identical to the fault-free one.

Each trial is a real job (coordinator, agent, state managers, trainer processes on gloo) with one
failure drawn from a seeded generator: a SIGKILL, an exception or a hang at a random rank,
iteration and phase — forward, backward, gradient protection, sync, inside a chunk's optimizer
update, during the parity update, during the parity write-back, inside a marker write, at the
boundary. In a subset the failure also destroys retained pages (holes punched in the state
managers' memfds): up to the first tier's tolerance in one or more protection groups plus one
first-tier parity page, or, in a smaller subset, more than the tolerance — which must be detected
and recovered by checkpoint-restart, still exactly.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from unbroken.config import (
    CheckpointConfig,
    DataConfig,
    JobConfig,
    ModelConfig,
    ParallelConfig,
    ProtectionConfig,
    RecoveryConfig,
    TrainConfig,
)

__all__ = ["add_arguments", "campaign_config", "draw_fault", "run"]

PHASES = (
    "forward",
    "backward",
    "protect",
    "sync",
    "update",
    "parity",
    "writeback",
    "marker",
    "boundary",
)


def campaign_config(preset: str, world_size: int, iterations: int) -> JobConfig:
    return JobConfig(
        model=ModelConfig(preset=preset),
        data=DataConfig(tokens_per_microbatch=128, microbatches=2, max_documents=300),
        train=TrainConfig(iterations=iterations, lr=1e-3),
        parallel=ParallelConfig(world_size=world_size),
        checkpoint=CheckpointConfig(interval=3),
        recovery=RecoveryConfig(heartbeat_interval_s=0.1, heartbeat_timeout_s=2.0),
        protection=ProtectionConfig(
            page_bytes=8192, stripe_pages=4, parity_pages=3, chunk_bytes=2048
        ),
    )


def draw_fault(rng: random.Random, cfg: JobConfig) -> tuple[str, str]:
    """One failure spec and its category (hof, pageloss, beyond)."""
    rank = rng.randrange(cfg.parallel.world_size)
    it = rng.randrange(1, cfg.train.iterations - 1)
    phase = rng.choice(PHASES)
    h1 = cfg.protection.resolved(cuda=False).parity_pages
    u = rng.random()
    where = f"rank={rank},iter={it},phase={phase}"
    if u < 0.10:
        return f"pageloss:{where},pages={h1 + rng.randint(1, 2)}", "beyond"
    if u < 0.50:
        groups = rng.randint(1, 3)
        return (
            f"pageloss:{where},pages={rng.randint(1, h1 - 1)},parity=1,groups={groups}",
            "pageloss",
        )
    kind = rng.choices(["kill", "exception", "hang"], weights=[8, 1, 1])[0]
    return f"{kind}:{where}", "hof"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trials", type=int, default=20, help="failure trials (default 20)")
    p.add_argument("--seed", type=int, default=0, help="seed of the failure draws")
    p.add_argument("--preset", default="tiny", help="model preset (default tiny)")
    p.add_argument("--world-size", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--iterations", type=int, default=10, help="iterations per trial")
    p.add_argument("--out", default=None, help="keep the run dirs here (default: a temp dir)")
    p.add_argument(
        "--external",
        action="store_true",
        help="instead: SIGKILL an active trainer from outside the job at a uniformly random "
        "time in each trial (unbroken.bench.kills)",
    )
    p.add_argument(
        "--kills-per-run",
        type=int,
        default=1,
        help="with --external: kills in each run, each after the previous one's recovery",
    )
    p.add_argument(
        "--aim-ms",
        type=float,
        default=None,
        help="with --external: aim each kill at the update, uniformly within this many ms "
        "before the predicted end of an iteration",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _external(args: argparse.Namespace, cfg: JobConfig, root: Path) -> int:
    from unbroken.bench.kills import run_campaign

    def say(text: str) -> None:
        print(f"[kills] {text}", file=sys.stderr, flush=True)

    result = run_campaign(
        cfg,
        root,
        trials=args.trials,
        seed=args.seed,
        kills_per_run=args.kills_per_run,
        aim_s=None if args.aim_ms is None else args.aim_ms / 1e3,
        say=say,
    )
    result["config"] = {"preset": args.preset, "world_size": args.world_size, "seed": args.seed}
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(
            f"external kills: trials {result['trials']} (of {result['drawn']} drawn; "
            f"{result['not_killed']} ended before their kill)  exact {result['exact']}  "
            f"undetected {result['undetected']}  where {result['where']}  "
            f"median recovery {result['median_recovery_s']} s "
            f"({result['seconds']:.0f}s, runs in {root})"
        )
    return 0 if result["all_exact"] and result["undetected"] == 0 else 1


def run(args: argparse.Namespace) -> int:
    from unbroken.api import run_job
    from unbroken.errors import UserError

    if args.trials < 1:
        raise UserError("--trials must be at least 1")
    cfg = campaign_config(args.preset, args.world_size, args.iterations)
    root = Path(args.out or tempfile.mkdtemp(prefix="unbroken-faults-"))
    if args.external:
        return _external(args, cfg, root)
    t0 = time.time()
    ref = run_job(cfg, root / "reference", quiet=True)
    reference_hash = ref.final_state_hash
    rng = random.Random(args.seed)
    records: list[dict[str, Any]] = []
    for trial in range(args.trials):
        spec, category = draw_fault(rng, cfg)
        trial_cfg = JobConfig(**{**{f: getattr(cfg, f) for f in cfg.__slots__}, "inject": [spec]})
        s = run_job(trial_cfg, root / f"trial{trial:03d}", quiet=True)
        modes = [r.mode for r in s.recoveries]
        rec = {
            "trial": trial,
            "fault": spec,
            "category": category,
            "state": s.state,
            "recovered": s.failures_recovered == s.failures_injected == 1,
            "modes": modes,
            "fallback": "ckpt_restart" in modes,
            "exact": s.final_state_hash == reference_hash,
            "total_s": [r.total_s for r in s.recoveries],
            "wall_s": s.faulty_wall_s,
        }
        records.append(rec)
        print(
            f"[faults] trial {trial + 1}/{args.trials}  {spec:62} "
            f"{'/'.join(modes) or '-':>13}  {'exact' if rec['exact'] else 'DIVERGED'}",
            file=sys.stderr,
            flush=True,
        )
    exact = sum(r["exact"] for r in records)
    result = {
        "trials": len(records),
        "exact": exact,
        "fallbacks": sum(r["fallback"] for r in records),
        "diverged": len(records) - exact,
        "unrecovered": sum(not r["recovered"] for r in records),
        "reference_state_hash": reference_hash,
        "seconds": time.time() - t0,
        "config": {"preset": args.preset, "world_size": args.world_size, "seed": args.seed},
        "records": records,
    }
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(
            f"trials {result['trials']}  exact {exact}  diverged {result['diverged']}  "
            f"fallbacks {result['fallbacks']} (each exact: "
            f"{all(r['exact'] for r in records if r['fallback'])})  "
            f"unrecovered {result['unrecovered']}  ({result['seconds']:.0f}s, runs in {root})"
        )
    return 0 if result["diverged"] == 0 and result["unrecovered"] == 0 else 1
