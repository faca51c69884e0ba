"""The planner's decisions on a fixed set of cluster states, as fingerprints to compare.

Owns the cases of `test_reference.py` and how one planning answer is fingerprinted: the bench's
planning-time states (256 and 4,096 GPUs), fail-slow and fail-stop states of a bench job under
every bench policy, and seeded random states drawn like `test_properties.cluster_states` under
the planner's configurations. A fingerprint holds the chosen layout, every predicted time (exact
floats), the explanation, and for the small states a digest of the emitted action lists and of
the simulator's full timeline of them (eager and blocking sends: every instant, the critical
path, the busy times, the deadlocks), so a change that alters any decision, any predicted time
or any simulated instant shows.

`fixtures/planner_reference.json` was written by the code *before* the planning-speed work
(the `src/` of orch 4a49af7, whose plan/parallel/sim/bench code c5c25f6 leaves unchanged, put
first on the path) with::

    PYTHONPATH=<orch 4a49af7>/src python -m tests.plan.reference

Re-run it only for a change that is meant to alter decisions, and say so in its commit.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
from collections.abc import Callable, Iterator
from pathlib import Path

from tests.plan.helpers import WORKLOAD, GiB, layout, state
from unbroken.parallel import simulate, timeline_csv
from unbroken.plan import NoPlanError, PlannerConfig, plan_for_state

__all__ = ["FIXTURE", "Case", "bench_state", "cases", "fingerprint", "random_state"]

FIXTURE = Path(__file__).parent / "fixtures" / "planner_reference.json"
Case = tuple[str, Callable[[], dict]]
CONFIGS = {
    "default": PlannerConfig(),
    "ownership=False": PlannerConfig(ownership=False),
    "exclusion-only": PlannerConfig(repartition=False, reorder=False, migration=False),
    "no-migration": PlannerConfig(migration=False, ownership=False),
}
BENCH_POLICIES = (
    "none",
    "greyhound",
    "adaptra",
    "recycle",
    "recycle+",
    "oobleck",
    "oobleck+",
    "resihp",
    "resihp-exclusion",
    "resihp-repartition",
)


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def fingerprint(result, *, full: bool) -> dict:
    """What the planner decided and predicted (`full`: also the emitted lists and their full
    simulated timeline, for states small enough to materialize)."""
    out = {
        "layout": repr(result.layout),
        "standbys": list(result.standbys),
        "current_s": repr(result.current_s),
        "predicted_s": repr(result.predicted_s),
        "kept_current": result.kept_current,
        "explain": result.explain().split("\n", 2)[::2],  # without the timing line
    }
    if full:
        plan = result.plan()
        out["actions"] = _digest(repr(sorted(plan.actions.items())))
        for sends in ("eager", "rendezvous"):
            timeline = simulate(plan, result.scorer.costs(result.layout), sends=sends)
            out[f"timeline/{sends}"] = _digest(
                timeline_csv(timeline)
                + repr((timeline.critical_path, sorted(timeline.busy.items())))
                + repr(timeline.deadlocks)
            )
            out[f"iteration_s/{sends}"] = repr(timeline.iteration_time)
    return out


def _planned(cluster, lay, config: PlannerConfig, *, full: bool = True) -> dict:
    try:
        return fingerprint(plan_for_state(cluster, config, current=lay), full=full)
    except NoPlanError as e:
        return {"no_plan": str(e)}


def random_state(seed: int):
    """A cluster state drawn as `test_properties.cluster_states` draws one, from a seed."""
    rng = random.Random(seed)
    dp, pp, tp = rng.randint(1, 3), rng.randint(1, 3), rng.choice((1, 2, 4))
    lay = layout(dp, pp, tp, rng.randint(pp, 6))
    peak = max(
        WORKLOAD.device_bytes(g.layers, g.tp, lay.inflight[d][s]) for (d, s), g in lay.groups()
    )
    memory = 40 * GiB if rng.random() < 0.5 else peak * rng.choice((1.0, 1.3, 2.0))
    cluster = state(lay, memory=memory, spare=rng.randint(0, 4))
    for r in lay.ranks:
        roll = rng.randint(0, 19)
        if roll < 3:
            cluster = cluster.with_lost(r)
        elif roll < 6:
            cluster = cluster.with_slow(r, speed=rng.choice((0.2, 0.5, 0.9)))
        elif roll < 8:
            cluster = cluster.with_slow(r, link_speed=rng.choice((0.002, 0.1)))
    return cluster, lay


def _scale(gpus: int) -> dict:
    from unbroken.bench._plan_jobs import SCALE_JOBS, initial_layout, initial_state
    from unbroken.bench.plan import MEMORY
    from unbroken.sim.presets import load_hardware

    spec = SCALE_JOBS[gpus]
    cluster = initial_state(spec, load_hardware("a100"), MEMORY["a100"])
    lay = initial_layout(spec)
    slow = lay.group(0, 5).ranks[1]
    lost = lay.group(0, min(9, spec.pp - 1)).ranks[2]
    failed = cluster.with_slow(slow, speed=0.4).with_lost(lost)
    return _planned(failed, lay, PlannerConfig(), full=gpus <= 256)


def bench_state(model: str, change: str):
    """(healthy state, its layout, the state after `change`) of a bench job: one GPU of
    replica 1's middle stage slowed in compute or link, or lost (mixed: and one slowed)."""
    from unbroken.bench._plan_jobs import JOBS, initial_layout, initial_state
    from unbroken.bench.plan import MEMORY
    from unbroken.sim.presets import load_hardware

    spec = JOBS[model]
    cluster = initial_state(spec, load_hardware("a100"), MEMORY["a100"])
    lay = initial_layout(spec)
    rank = lay.group(1, spec.pp // 2).ranks[1]
    changed = {
        "compute": lambda: cluster.with_slow(rank, speed=0.3),
        "link": lambda: cluster.with_slow(rank, link_speed=0.05),
        "lost": lambda: cluster.with_lost(rank),
        "mixed": lambda: cluster.with_lost(rank).with_slow(lay.group(0, 0).ranks[0], speed=0.5),
    }[change]()
    return cluster, lay, changed


def _bench_policies(model: str, change: str) -> dict:
    """Every bench policy's answer to one changed state of a bench job."""
    from unbroken.bench._plan_scenarios import policies

    cluster, lay, changed = bench_state(model, change)
    out = {}
    for policy in policies(BENCH_POLICIES, lay, cluster, {}):
        o = policy.react(changed)
        out[policy.name] = {
            "time_s": repr(o.time_s),
            "layouts": [repr(x) for x in o.layouts],
            "reason": o.reason,
            "notes": list(o.notes),
            "moved_bytes": repr(o.moved_bytes),
        }
    return out


def cases(*, scale: bool = True) -> Iterator[Case]:
    """(name, thunk) of every reference case (`scale`: include the 4,096-GPU one)."""
    yield "scale/256", lambda: _scale(256)
    if scale:
        yield "scale/4096", lambda: _scale(4096)
    for model in ("llama2-13b", "qwen2.5-7b"):
        for change in ("compute", "link", "lost", "mixed"):
            yield f"bench/{model}/{change}", lambda m=model, c=change: _bench_policies(m, c)
    for seed in range(40):
        for name, config in CONFIGS.items():
            if seed % 4 == 0 or name == "default":
                yield (
                    f"random/{seed}/{name}",
                    lambda s=seed, c=config: _planned(*random_state(s), c),
                )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--write", type=Path, default=FIXTURE)
    args = p.parse_args()
    record = {name: thunk() for name, thunk in cases()}
    args.write.parent.mkdir(parents=True, exist_ok=True)
    args.write.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    print(f"{len(record)} cases -> {args.write}")


if __name__ == "__main__":
    main()
