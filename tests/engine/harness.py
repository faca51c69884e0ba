"""Run plans on local gloo processes and the single-process reference, and compare them.

`run_plans(cases, world_size, tmp)` starts `world_size` processes once (spawn, FileStore in
`tmp`), runs every case's plan for its iterations in turn (each case builds its own groups, a
new `PlanGroups` per plan), and returns per case the losses and the full (unsharded) gradients
and parameters of every replica after the last iteration. `reference(cfg, dp, iterations)` runs
the same iterations through `unbroken.train`'s `Trainer` in this process, shard by shard, with
the data-parallel average done the way the trainer's all-reduce does it.
"""

from __future__ import annotations

import contextlib
import pickle
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch

from unbroken.config import DataConfig, JobConfig, ModelConfig, ProtectionConfig, TrainConfig
from unbroken.parallel import ParallelPlan

ENGINE_MODEL = ModelConfig(preset="tiny", dim=64, n_layers=4, n_heads=16, n_kv_heads=8, ffn_dim=128)
"""Tiny, with GQA (2 query heads per kv-group) and sizes every TP degree up to 8 divides."""


def engine_job(*, microbatches: int = 4, tokens: int = 32, grad_clip: float = 1.0) -> JobConfig:
    return JobConfig(
        model=ENGINE_MODEL,
        data=DataConfig(tokens_per_microbatch=tokens, microbatches=microbatches, max_documents=60),
        train=TrainConfig(iterations=10, lr=1e-3, grad_clip=grad_clip),
        protection=ProtectionConfig(page_bytes=4096, stripe_pages=2, chunk_bytes=1024),
    )


@dataclass(frozen=True)
class Case:
    name: str
    plan: ParallelPlan
    cfg: JobConfig
    iterations: int = 2
    then: ParallelPlan | None = None
    """Re-plan to this after `iterations` (`unbroken.engine.reshard`), then run `after` more."""
    after: int = 1
    dead: tuple[int, ...] = ()
    """Ranks whose old state is lost at the re-plan (filled with NaN before resharding)."""
    switch: bool = False
    """Switch to `then` live (`engine.build.switch_plan`: the same state, no reshard)."""
    shards: int | None = None
    """Logical data shards (default: the plan's replicas); a plan whose replicas own other
    counts than the launch plan's (a dissolved replica) reads the launch plan's shards."""

    @property
    def final_plan(self) -> ParallelPlan:
        return self.then or self.plan


@dataclass
class Outcome:
    losses: list[float]
    grad_norms: list[float]
    grads: list[dict[str, torch.Tensor]]
    """Per replica: full gradient tensors by name (after the DP average)."""
    params: list[dict[str, torch.Tensor]]
    """Per replica: full parameters after the last update."""
    probes: dict[int, int] = field(default_factory=dict)
    """Per rank: probe actions it timed in the last iteration (`unbroken.engine.probe`)."""


@contextlib.contextmanager
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def reference(cfg: JobConfig, dp: int, iterations: int) -> Outcome:
    """The single-process `unbroken.train` path for a `dp`-replica job."""
    from tests.foundation.conftest import local_trainer
    from unbroken.train import lr_at

    with one_thread():
        built, tr = local_trainer(cfg, n_shards=dp)
        losses, norms = [], []
        grads = built.state.grads
        for it in range(iterations):
            total, loss_sum = torch.zeros_like(grads), 0.0
            for shard in range(dp):
                tr.shard = shard
                loss, _, _ = tr.compute(it)
                loss_sum += loss
                total += grads
            grads.copy_(total).div_(dp)  # the trainer's all-reduce (a sum), then / dp
            loss, norm, scale = tr.sync(it, loss_sum)
            tr.updater.update(it, lr=lr_at(cfg.train, it), grad_scale=scale, hook=tr._hook)
            losses.append(loss / dp)
            norms.append(norm)
        layout = built.state.layout
        g = {k: v.clone() for k, v in layout.views(built.state.grads).items()}
        p = {k: v.clone() for k, v in layout.views(built.state.params).items()}
    return Outcome(losses, norms, [g], [p])


@contextlib.contextmanager
def gloo_rank(rank: int, world_size: int, store_path: str, out: str, record):
    """The rank side of `spawn_ranks`: one thread and a gloo group over the FileStore (yielded);
    a failure's traceback goes to `error-{rank}.txt`; at the end `record` is pickled to
    `rank{rank}.pkl` (what it holds so far, on failure too) and the group destroyed."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=60)
    )
    try:
        yield dist.group.WORLD
    except BaseException:
        Path(out, f"error-{rank}.txt").write_text(traceback.format_exc())
        raise
    finally:
        with open(Path(out, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(record, f)
        dist.destroy_process_group()


def _worker(rank: int, world_size: int, store_path: str, cases: list[Case], out: str) -> None:
    from unbroken.engine.build import build_worker, make_source

    results, sources = [], {}
    with gloo_rank(rank, world_size, store_path, out, results) as world:
        for case in cases:
            t0 = time.perf_counter()
            key = (repr(case.cfg.data), case.shards or case.plan.dp)
            if key not in sources:
                sources[key] = make_source(case.cfg, key[1])
            er = build_worker(
                case.cfg, case.plan, world, device=torch.device("cpu"), source=sources[key]
            )
            t1 = time.perf_counter()
            losses, norms = [], []
            for it in range(case.iterations):
                res = er.worker.run_iteration(it)
                losses.append(res.loss)
                norms.append(res.grad_norm)
            if case.then is not None and case.switch:
                from unbroken.engine.build import switch_plan

                switch_plan(case.cfg, er, case.then, world)
                for it in range(case.iterations, case.iterations + case.after):
                    res = er.worker.run_iteration(it)
                    losses.append(res.loss)
                    norms.append(res.grad_norm)
            elif case.then is not None:
                er, losses, norms = _replan(case, er, world, sources, losses, norms)
            layout = er.state.layout
            located = case.final_plan.locate(rank) if rank in case.final_plan.ranks else None
            results.append(
                {
                    "losses": losses,
                    "norms": norms,
                    "seconds": (t1 - t0, time.perf_counter() - t1),
                    "probes": len(er.worker.timing.probe) if er.worker.timing else 0,
                    "replica": located[0] if located else None,
                    "tp": (er.groups.tp.size, er.groups.tp.rank),
                    "grads": {k: v.clone() for k, v in layout.views(er.state.grads).items()},
                    "params": {k: v.clone() for k, v in layout.views(er.state.params).items()},
                }
            )


def _replan(case: Case, er, world, sources, losses, norms):
    """Reshard `er`'s state onto `case.then` and run `case.after` iterations there."""
    import torch.distributed as dist

    from unbroken.engine.build import build_worker, make_source
    from unbroken.engine.reshard import reshard
    from unbroken.model import resolve_args
    from unbroken.train import TrainState

    rank = dist.get_rank(world)
    segments = ("params", "exp_avg", "exp_avg_sq")
    old_layout = er.state.layout
    old = {seg: old_layout.views(getattr(er.state, seg)) for seg in segments}
    if rank in case.dead:
        for seg in segments:
            getattr(er.state, seg).fill_(float("nan"))

    def allocate(layout, geometry, device):
        return TrainState.allocate(layout, device, geometry.padded_numel), False

    key = (repr(case.cfg.data), case.shards or case.then.dp)
    if key not in sources:
        sources[key] = make_source(case.cfg, key[1])
    new_er = build_worker(
        case.cfg,
        case.then,
        world,
        device=torch.device("cpu"),
        source=sources[key],
        allocate=allocate,
    )
    new = {seg: new_er.state.layout.views(getattr(new_er.state, seg)) for seg in segments}
    in_old = rank in case.plan.ranks and rank not in case.dead
    alive = [r for r in case.plan.ranks if r not in case.dead]
    reshard(
        case.plan,
        case.then,
        resolve_args(case.cfg.model),
        world,
        old if in_old else {},
        new if rank in case.then.ranks else {},
        alive,
    )
    for it in range(case.iterations, case.iterations + case.after):
        res = new_er.worker.run_iteration(it)
        losses.append(res.loss)
        norms.append(res.grad_norm)
    return new_er, losses, norms


def _assemble(case: Case, per_rank: list[dict], key: str) -> list[dict[str, torch.Tensor]]:
    from unbroken.engine.sharding import replicated, unshard

    out = []
    for d in range(case.final_plan.dp):
        pieces: dict[str, dict[int, torch.Tensor]] = {}
        for r in case.final_plan.ranks:
            res = per_rank[r]
            if res["replica"] != d:
                continue
            for name, t in res[key].items():
                pieces.setdefault(name, {})[res["tp"][1]] = t
        for name, p in pieces.items():  # a replicated tensor must stay identical on every copy
            if replicated(name) and not all(torch.equal(p[0], q) for q in p.values()):
                raise AssertionError(
                    f"{case.name}: replica {d}: TP copies of {name} ({key}) differ"
                )
        out.append({n: unshard(n, [p[i] for i in sorted(p)]) for n, p in pieces.items()})
    return out


def spawn_ranks(target, payload, world_size: int, tmp: Path, preload: list[str], what: str):
    """Run `target(rank, world_size, store_path, payload, out)` on `world_size` processes
    forked by a fork server that imported `preload` once (no per-rank import, and no fork of
    this threaded test process); each rank leaves `rank{r}.pkl`, and on failure
    `error-{r}.txt`. Returns the unpickled records by rank.

    Raises:
        AssertionError: a rank failed (every rank's error attached: the first may be a peer's).
    """
    import torch.multiprocessing as mp

    tmp.mkdir(parents=True, exist_ok=True)
    mp.get_context("forkserver").set_forkserver_preload(preload)
    try:
        mp.start_processes(
            target,
            args=(world_size, str(tmp / "store"), payload, str(tmp)),
            nprocs=world_size,
            start_method="forkserver",
        )
    except Exception as exc:
        detail = "\n".join(p.read_text() for p in sorted(tmp.glob("error-*.txt")))
        raise AssertionError(f"{what} failed: {exc}\n{detail}") from None
    per_rank = []
    for r in range(world_size):
        with open(tmp / f"rank{r}.pkl", "rb") as f:
            per_rank.append(pickle.load(f))
    return per_rank


def run_plans(cases: list[Case], world_size: int, tmp: Path) -> dict[str, Outcome]:
    """Run every case on `world_size` spawned gloo processes; outcomes by case name."""
    preload = ["torch", "torch.distributed", "unbroken.engine.build", __name__]
    per_rank = spawn_ranks(_worker, cases, world_size, tmp, preload, "engine workers")
    outcomes = {}
    for i, case in enumerate(cases):
        rows = [per_rank[r][i] for r in range(world_size)]
        first = rows[case.final_plan.ranks[0]]
        outcomes[case.name] = Outcome(
            losses=first["losses"],
            grad_norms=first["norms"],
            grads=_assemble(case, rows, "grads"),
            params=_assemble(case, rows, "params"),
            probes={r: row["probes"] for r, row in enumerate(rows)},
        )
    return outcomes


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def max_rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest difference of a tensor, relative to the largest magnitude in `b`'s tensor
    (how far a sum in another order may drift scales with the terms summed)."""
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-30)) for k in a)


def bit_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def assert_same_run(ref: Outcome, got: Outcome) -> None:
    """`got` ended where `ref` did: the same losses and gradient norms, and the first
    replica's parameters bit for bit."""
    assert got.losses == ref.losses and got.grad_norms == ref.grad_norms
    assert bit_equal(got.params[0], ref.params[0])


__all__ = [
    "ENGINE_MODEL",
    "Case",
    "Outcome",
    "assert_same_run",
    "bit_equal",
    "engine_job",
    "max_abs_diff",
    "reference",
    "run_plans",
    "spawn_ranks",
]
