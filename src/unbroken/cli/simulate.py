"""`unbroken simulate`: predict ETTR and recovery cost of a cluster (Leto App. C), check the
prediction against a real run (`--validate`), or derive a per-stage profile from a real run
(`--profile-from`). See docs/simulator.md."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import time
from pathlib import Path
from types import MappingProxyType

from unbroken.errors import UserError

__all__ = ["add_parser", "run"]

_UNITS = MappingProxyType({"": 1.0, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0})


def _durations(text: str) -> list[float]:
    """Parse "600", "30m", "1h" or a comma list of them into seconds."""
    out = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*", part)
        if not m or m.group(2) not in _UNITS or float(m.group(1)) <= 0:
            raise UserError(f"--mttf {text!r}: expected seconds or a duration like 30m, 1h")
        out.append(float(m.group(1)) * _UNITS[m.group(2)])
    return out


def _ratios(text: str) -> list[float]:
    try:
        vals = [float(p) for p in text.split(",")]
    except ValueError:
        raise UserError(f"--hof {text!r}: expected ratios like 0,0.5,1") from None
    if not all(0.0 <= v <= 1.0 for v in vals):
        raise UserError(f"--hof {text!r}: ratios must lie in [0, 1]")
    return vals


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add the `simulate` subcommand."""
    parser = sub.add_parser(
        "simulate",
        help="predict ETTR and recovery cost at scale (Leto App. C), or --validate a real run",
        description=(
            "Predict iteration time, recovery time and ETTR of recovery policies (inplace, "
            "gemini+, gemini, jit) for a cluster, from a preset or a cluster.toml; or predict a "
            "real run's ETTR from its measured parts and compare with the measured value."
        ),
    )
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--preset", metavar="NAME", help="a shipped scenario (e.g. leto-fig14)")
    what.add_argument("--config", metavar="TOML", help="your cluster (see examples/cluster.toml)")
    what.add_argument(
        "--validate", metavar="RUN_DIR", nargs="+", help="output dir(s) of unbroken train/demo"
    )
    what.add_argument(
        "--profile-from",
        metavar="RUN_DIR",
        help="write the per-stage profile JSON of a train/demo output dir and check its T_iter",
    )
    what.add_argument("--list", action="store_true", help="list presets, models and hardware")
    parser.add_argument("--mttf", metavar="T", help="MTTF(s): seconds or 30m, 1h; comma list")
    parser.add_argument("--hof", metavar="H", help="HOF ratio(s), comma list, e.g. 0,0.5,1")
    parser.add_argument("--policies", metavar="P", help="comma list of inplace,gemini+,gemini,jit")
    parser.add_argument("--trace", metavar="CSV", help="replay this failure trace (t_s,kind)")
    parser.add_argument(
        "--interval", type=int, metavar="I", help="fixed checkpoint interval (default: Young)"
    )
    parser.add_argument("--des", action="store_true", help="also run the discrete-event mode")
    parser.add_argument("--replications", type=int, help="discrete-event replications")
    parser.add_argument("--horizon-mttf", type=float, help="discrete-event run length in MTTFs")
    parser.add_argument("--seed", type=int, help="discrete-event base seed")
    parser.add_argument(
        "--profile-out",
        metavar="FILE",
        help="--profile-from's output (default RUN_DIR/profile.json)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object, no table")
    parser.add_argument("--png", metavar="PATH", help="chart path (default: runs/sim/NAME.png)")
    parser.add_argument("--no-png", action="store_true", help="do not write a chart")
    parser.set_defaults(func=run)


class _Progress:
    """Throttled one-line progress on stderr for long discrete-event runs."""

    def __init__(self) -> None:
        self.last = 0.0
        self.start = time.monotonic()

    def __call__(self, message: str) -> None:
        now = time.monotonic()
        if now - self.last >= 0.5:
            self.last = now
            print(f"[simulate {now - self.start:6.1f}s] {message}", file=sys.stderr, flush=True)


def _list() -> int:
    from unbroken.sim.presets import hardware_names, model_names
    from unbroken.sim.scenario import preset_names

    print("scenario presets:", ", ".join(preset_names()))
    print("model presets:   ", ", ".join(model_names()))
    print("hardware presets:", ", ".join(hardware_names()))
    return 0


def _validate(args: argparse.Namespace) -> int:
    from unbroken.sim.validate import validate_run

    results = [validate_run(d) for d in args.validate]
    if args.json:
        print(json.dumps({"validations": [r.as_dict() for r in results]}, indent=1))
        return 0
    head = (
        f"{'run':36}{'iters':>6}{'fails':>6}{'I':>4}{'measured %':>12}{'predicted %':>13}"
        f"{'error pts':>11}{'closed %':>10}"
    )
    print(head)
    print("-" * len(head))
    for r in results:
        print(
            f"{r.run_dir[-36:]:36}{r.iterations:>6}{len(r.failures):>6}{r.ckpt_interval:>4}"
            f"{r.measured_ettr * 100:>12.2f}{r.predicted_ettr * 100:>13.2f}"
            f"{r.error_points:>+11.2f}{r.closed_form_ettr * 100:>10.2f}"
        )
        print(
            f"    inputs: T_iter {r.t_iter_s:.3f}s (reference), steady overhead "
            f"{r.omega * 100:+.1f}%, checkpoint {r.ckpt_s:.3f}s every {r.ckpt_interval} it; "
            f"elapsed measured {r.measured_wall_s:.1f}s, predicted {r.predicted_wall_s:.1f}s"
        )
        for f in r.failures:
            print(
                f"    failure at it {f['iteration']} ({f['phase']}, {f['fraction']:.2f} in): "
                f"{f['mode']} -> modelled as {f['kind']}, init {f['init_s']:.2f}s; "
                f"recompute predicted {f.get('predicted_recompute_s', 0.0):.2f}s, "
                f"measured {f['recompute_s'] if f['recompute_s'] is not None else float('nan'):.2f}s"
            )
        for note in r.notes:
            print(f"    note: {note}")
    return 0


def _profile_from(args: argparse.Namespace) -> int:
    from unbroken.sim.from_run import profile_from_run

    result = profile_from_run(args.profile_from)
    out = Path(args.profile_out or Path(args.profile_from) / "profile.json")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result.profile, indent=1) + "\n")
    except OSError as exc:
        raise UserError(f"--profile-out {out}: {exc.strerror}") from None
    if args.json:
        print(json.dumps({"profile": str(out), **result.as_dict()}, indent=1))
        return 0
    b, prof = result.breakdown, result.profile
    print(f"profile: {out}")
    print(
        f"  from run {result.run!r} of {result.run_dir} ({result.kind}, {result.iterations} "
        f"steady iterations): {len(prof['stages'])} stages, vpp {prof['vpp']}, "
        f"{prof['microbatches']} micro-batches"
    )
    print(
        f"  predicted T_iter {b.iter_s * 1e3:.1f} ms = pipeline {b.pipeline_s * 1e3:.1f} "
        f"+ sync {b.sync_s * 1e3:.1f} + update {b.update_s * 1e3:.1f}"
    )
    if result.measured_iter_s is not None:
        print(
            f"  measured iteration {result.measured_iter_s * 1e3:.1f} ms (run_iteration, slowest "
            f"rank, median): error {result.error * 100:+.1f}%"
        )
    spaced = result.predicted_iter_s / result.measured_spacing_s - 1.0
    print(
        f"  measured start-to-start {result.measured_spacing_s * 1e3:.1f} ms (with the runtime's "
        f"per-iteration bookkeeping): error {spaced * 100:+.1f}%"
    )
    for name in result.fitted:
        print(f"  note: {name} is fitted to the measured iteration: {prof['derived'][name]}")
    print(f'  use it: [[workload]] profile = "{out}" in a cluster.toml (--config)')
    return 0


def run(args: argparse.Namespace) -> int:
    """Run `unbroken simulate`."""
    if args.profile_out and not args.profile_from:
        raise UserError("--profile-out goes with --profile-from RUN_DIR")
    if args.list:
        return _list()
    if args.validate:
        return _validate(args)
    if args.profile_from:
        return _profile_from(args)
    from unbroken.sim.report import format_table, format_workloads, json_document, write_chart
    from unbroken.sim.scenario import evaluate, load_scenario, workload_summary
    from unbroken.sim.trace import read_trace

    scenario = load_scenario(preset=args.preset, config=args.config)
    sweep = scenario.sweep
    if args.mttf:
        sweep = dataclasses.replace(sweep, mttf_s=tuple(_durations(args.mttf)))
    if args.hof:
        sweep = dataclasses.replace(sweep, hof_ratio=tuple(_ratios(args.hof)))
    scenario.sweep = sweep
    sim = scenario.sim
    if args.policies:
        sim = dataclasses.replace(sim, policies=tuple(p.strip() for p in args.policies.split(",")))
    for field, value in (
        ("replications", args.replications),
        ("horizon_mttf", args.horizon_mttf),
        ("seed", args.seed),
    ):
        if value is not None:
            sim = dataclasses.replace(sim, **{field: value})
    scenario.sim = sim
    if args.interval is not None:
        if args.interval < 1:
            raise UserError(f"--interval must be >= 1, got {args.interval}")
        scenario.recovery = dataclasses.replace(scenario.recovery, ckpt_interval=args.interval)
    if args.trace:
        scenario.trace = read_trace(args.trace)
    des = True if (args.des or args.trace) else None
    rows, skipped = evaluate(scenario, des=des, progress=_Progress())
    if not args.no_png:
        name = scenario.name if not args.mttf else f"{scenario.name}-mttf{args.mttf}"
        png = Path(args.png or f"runs/sim/{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}.png")
        title = f"unbroken simulate: {scenario.name} (closed-form ETTR, Leto App. C.3)"
        write_chart(rows, png, title)
        print(f"chart: {png}", file=sys.stderr)
    workloads = [workload_summary(w) for w in scenario.workloads]
    if args.json:
        print(json.dumps(json_document(rows, skipped, scenario.name, workloads), indent=1))
    else:
        print(format_workloads(workloads))
        print()
        print(format_table(rows, skipped))
    return 0
