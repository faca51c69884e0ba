"""One rank of `unbroken bench engine`: our interpreter and torch's `Schedule1F1B`, same job.

Run as ``python -m unbroken.bench.engine_ranks SPEC RANK`` (a process per rank, FileStore
rendezvous). For every plan in the spec, in one process group:

1. ours: `build_worker` + `PlanWorker.run_iteration`, with the per-action profile on;
2. the baseline: `torch.distributed.pipelining.PipelineStage` + `Schedule1F1B` over a TP-1
   `StageModel` with the same layer split, the same initial values, the same micro-batches, the
   same loss scaling, then the same DP all-reduce, the same loss/norm all-reduce and the same
   chunked AdamW (`PlainUpdater`) on the same kind of flat buffers;
3. calibration for the simulator: our untimed lead-in iteration of every block, with its p2p
   batches timestamped (`_StampedProfile`; the ranks are processes on one host, and
   `time.perf_counter` is CLOCK_MONOTONIC there, one clock for all of them), so the parent can
   tell how long a batch took once every transfer in it could start ([Note: p2p delivery] in
   `unbroken.bench.engine`), and its REDUCE_GRAD spans; for the ping-pong model it replaces,
   the one-way time of one activation by ping-pong between the ranks of adjacent stages and
   the DP gradient all-reduce on its own.

Ours and the baseline alternate in blocks of iterations (and which goes first) so machine-load
drift hits both alike. Every timed iteration also records the rank's CPU seconds
(`time.process_time`, gloo's threads included): on a machine with fewer cores than ranks, wall
time depends on which process the scheduler runs, CPU time on the work done.
Rank 0 writes the per-iteration times, every rank's profile and CPU times, the lead-in spans
and the other calibration to RESULT.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from unbroken.config import DataConfig, JobConfig, ModelConfig, ProtectionConfig, TrainConfig
from unbroken.engine.build import build_worker, full_initial_params
from unbroken.engine.replica import state_geometry
from unbroken.engine.sharding import load_from_full
from unbroken.engine.stage import MicroBatchInputs, StageModel
from unbroken.engine.tp import TPGroup
from unbroken.model import FlatLayout, materialize, resolve_args
from unbroken.model.flat import bind_grads
from unbroken.parallel import ParallelPlan
from unbroken.train import AdamW, TrainState, lr_at
from unbroken.update import ChunkStep, PlainUpdater


class _TorchStage(nn.Module):
    """A `StageModel` range behind the call signature `PipelineStage` drives."""

    def __init__(self, model: StageModel, layers: tuple[int, int], loss_div: float) -> None:
        super().__init__()
        self.model, self.layers, self.loss_div = model, layers, loss_div

    def forward(self, x, positions, segment_ids, targets):
        t = positions.shape[0]
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        mask = causal & (segment_ids[:, None] == segment_ids[None, :])
        first = self.layers[0] == 0
        inputs = MicroBatchInputs(x if first else None, targets, positions, mask)
        out = self.model(self.layers, None if first else x, inputs)
        if self.layers[1] == self.model.args.n_layers:
            return out / self.loss_div
        return out


class _Baseline:
    """torch.distributed.pipelining on this rank's stages of `plan`: `Schedule1F1B`, or
    `ScheduleInterleaved1F1B` over its virtual stages for an interleaved plan."""

    def __init__(self, cfg: JobConfig, plan: ParallelPlan, rank: int, source) -> None:
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleInterleaved1F1B,
        )

        args = resolve_args(cfg.model)
        pp_groups, dp_groups = {}, {}
        for d, rep in enumerate(plan.replicas):  # every rank creates every group, in order
            pp_groups[d] = dist.new_group([g.ranks[0] for g in rep.stages[: plan.pp]])
        for s in range(plan.pp):
            dp_groups[s] = dist.new_group([rep.stages[s].ranks[0] for rep in plan.replicas])
        self.world = dist.group.WORLD
        self.standby = rank not in plan.ranks
        if self.standby:  # a rank the plan leaves out only joins the world-wide all-reduce
            return
        d, s = plan.locate(rank)
        self.replica, self.stage = d, s
        self.dp_group, self.dp = dp_groups[s], plan.dp
        mine = [k for k in range(plan.num_stages) if k % plan.pp == s]  # virtual stages
        ranges = [plan.replicas[d].stages[k].layers for k in mine]
        self.first, self.last = 0 in mine, plan.num_stages - 1 in mine
        model = StageModel(args, ranges, TPGroup(), device="meta")
        layout = FlatLayout.of(model)
        geometry = state_geometry(cfg, layout.numel)
        self.state = TrainState.allocate(layout, "cpu", geometry.padded_numel)
        load_from_full(full_initial_params(cfg), layout, self.state.params, 1, 0)
        materialize(model, layout, self.state.params)
        bind_grads(model, layout, self.state.grads)
        step = ChunkStep.for_layout(geometry, AdamW.from_config(cfg.train), layout)
        self.updater = PlainUpdater(self.state, geometry, step)
        self.cfg, self.source = cfg, source
        m, div = plan.microbatches[d], plan.total_microbatches / plan.dp
        pipes = [
            PipelineStage(
                _TorchStage(model, layers, div),
                k,
                plan.num_stages,
                torch.device("cpu"),
                group=pp_groups[d],
            )
            for k, layers in zip(mine, ranges, strict=True)
        ]
        loss = lambda out, _target: out  # noqa: E731 - the last stage returns its loss already
        if plan.virtual_stages > 1:
            self.schedule = ScheduleInterleaved1F1B(pipes, m, loss_fn=loss, scale_grads=False)
        else:
            self.schedule = Schedule1F1B(pipes[0], m, loss_fn=loss, scale_grads=False)

    def run_iteration(self, iteration: int) -> None:
        if self.standby:
            dist.all_reduce(torch.zeros(2, dtype=torch.float64), group=self.world)
            return
        self.state.grads.zero_()
        mbs = self.source.iteration(iteration, self.replica)
        cat = {k: torch.cat([getattr(mb, k) for mb in mbs]) for k in ("tokens", "targets")}
        kwargs = {
            "positions": torch.cat([mb.positions for mb in mbs]),
            "segment_ids": torch.cat([mb.segment_ids for mb in mbs]),
            "targets": cat["targets"],
        }
        losses: list = []
        args = (cat["tokens"],) if self.first else ()
        target = cat["targets"] if self.last else None
        self.schedule.step(*args, target=target, losses=losses, return_outputs=False, **kwargs)
        if self.dp > 1:
            dist.all_reduce(self.state.grads, group=self.dp_group)
            self.state.grads.div_(self.dp)
        loss = float(sum(x.detach() for x in losses)) if losses else 0.0
        sq = float(self.state.grads.double().square().sum()) if self.replica == 0 else 0.0
        t = torch.tensor([loss, sq], dtype=torch.float64)
        dist.all_reduce(t, group=self.world)
        norm = float(t[1]) ** 0.5
        clip = self.cfg.train.grad_clip
        scale = min(1.0, clip / (norm + 1e-6)) if clip > 0 else 1.0
        with torch.no_grad():
            self.updater.update(
                iteration, lr=lr_at(self.cfg.train, iteration), grad_scale=scale, hook=_no_hook
            )


def _no_hook(*_args) -> None:
    pass


class _StampedList(list):
    """Seconds of one kind of step, as `PlanWorker.profile` appends them, plus when each ended."""

    def __init__(self) -> None:
        super().__init__()
        self.ends: list[float] = []

    def append(self, seconds: float) -> None:
        self.ends.append(time.perf_counter())  # the worker appends right as the step ends
        super().append(seconds)

    def spans(self) -> list[tuple[float, float]]:
        """(start, end) of every step, in order."""
        return [(end - s, end) for s, end in zip(self, self.ends, strict=True)]


class _StampedProfile(dict):
    """A `PlanWorker.profile` whose lists also keep each step's end time (`_StampedList`).

    The worker records with ``profile.setdefault(key, []).append(seconds)``; a new key gets a
    `_StampedList` instead of the default. `tests/engine/test_bench.py` checks the spans against
    a real worker, so a change in how it records shows there.
    """

    def setdefault(self, key, default=None):
        if key not in self:
            self[key] = _StampedList()
        return self[key]


def _link_seconds(plan: ParallelPlan, rank: int, numel: int, reps: int) -> float:
    """One-way time of one activation between the ranks of stages 0 and 1 of replica 0."""
    if plan.pp < 2:
        return 0.0
    a, b = plan.replicas[0].stages[0].ranks[0], plan.replicas[0].stages[1].ranks[0]
    buf, world = torch.zeros(numel), dist.group.WORLD
    dist.barrier(group=world)
    t0 = time.perf_counter()
    for _ in range(reps):
        if rank == a:
            dist.send(buf, group=world, group_dst=b)
            dist.recv(buf, group=world, group_src=b)
        elif rank == b:
            dist.recv(buf, group=world, group_src=a)
            dist.send(buf, group=world, group_dst=a)
    seconds = (time.perf_counter() - t0) / (2 * reps)
    t = torch.tensor([seconds if rank == a else 0.0], dtype=torch.float64)
    dist.all_reduce(t, group=world)
    return float(t[0])


def _reduce_seconds(groups, grads: torch.Tensor, reps: int) -> float:
    """The DP gradient all-reduce alone (max over ranks of the mean)."""
    if groups.dp is None:
        seconds = 0.0
    else:
        dist.barrier(group=groups.world)
        t0 = time.perf_counter()
        for _ in range(reps):
            dist.all_reduce(grads, group=groups.dp)
        seconds = (time.perf_counter() - t0) / reps
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=groups.world)
    return float(t[0])


def job_config(spec: dict) -> JobConfig:
    return JobConfig(
        model=ModelConfig(preset=spec["preset"]),
        data=DataConfig(
            tokens_per_microbatch=spec["tokens"],
            microbatches=spec["microbatches"],
            max_documents=spec["max_documents"],
        ),
        train=TrainConfig(iterations=1000, lr=1e-3),
        protection=ProtectionConfig(page_bytes=65536, stripe_pages=4, chunk_bytes=16384),
    )


def _time_block(fn, first: int, n: int) -> tuple[list[float], list[float]]:
    """Wall and CPU seconds of iterations first .. first + n - 1."""
    wall, cpu = [], []
    for i in range(first, first + n):
        t0, c0 = time.perf_counter(), time.process_time()
        fn(i)
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return wall, cpu


def _run_plan(spec: dict, plan: ParallelPlan, rank: int) -> dict:
    cfg = job_config(spec)
    world = dist.group.WORLD
    ours = build_worker(cfg, plan, world, device=torch.device("cpu"))
    base = _Baseline(cfg, plan, rank, ours.worker.source)
    warm, block, rounds = spec["warmup"], spec["block"], spec["rounds"]
    for i in range(warm):
        ours.worker.run_iteration(i)
        base.run_iteration(i)
    # Every block opens with one untimed lead-in iteration (for both engines, so switching
    # engines costs neither). Ours has its p2p batches and REDUCE_GRAD timestamped there: the
    # simulator's calibration, spread over the run like the timed iterations but never one of
    # them ([Note: p2p delivery] in unbroken.bench.engine).
    stamped, timed = _StampedProfile(), {}
    times: dict[str, list[float]] = {"ours": [], "baseline": []}
    cpu: dict[str, list[float]] = {"ours": [], "baseline": []}
    it = warm
    engines = [("ours", ours.worker.run_iteration), ("baseline", base.run_iteration)]
    for r in range(rounds):  # alternate which engine goes first: load drift hits both alike
        for name, step in engines if r % 2 == 0 else engines[::-1]:
            dist.barrier(group=world)
            if name == "ours":
                ours.worker.profile = stamped
            step(it)
            ours.worker.profile = timed
            wall, cpu_s = _time_block(step, it + 1, block)
            times[name] += wall
            cpu[name] += cpu_s
        it += block + 1
    spans = {k: stamped[k].spans() if k in stamped else [] for k in ("BATCH", "REDUCE_GRAD")}
    numel = spec["tokens"] * resolve_args(cfg.model).dim
    link = _link_seconds(plan, rank, numel, reps=20)
    reduce = _reduce_seconds(ours.groups, ours.state.grads, reps=10)
    profile = {k: statistics.fmean(v) for k, v in timed.items()}
    mine = {"profile": profile, "cpu": cpu, "spans": spans}
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine, group=world)
    return {
        "times": times,
        "profiles": [e["profile"] for e in every],
        "cpu": [e["cpu"] for e in every],
        "calibration": {
            "iterations": rounds,
            "batches": [e["spans"]["BATCH"] for e in every],
            "reduce_grad": [e["spans"]["REDUCE_GRAD"] for e in every],
        },
        "link": link,
        "reduce_grad_alone": reduce,
    }


def _main(argv: list[str]) -> None:
    spec = json.loads(Path(argv[0]).read_text())
    rank = int(argv[1])
    torch.set_num_threads(spec["threads"])
    store = dist.FileStore(spec["store"], spec["world_size"])
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=spec["world_size"], timeout=timedelta(minutes=5)
    )
    results = {}
    for name, plan_json in spec["plans"].items():
        results[name] = _run_plan(spec, ParallelPlan.from_json(plan_json), rank)
        if rank == 0:
            print(f"  {name}: measured", file=sys.stderr, flush=True)
    if rank == 0:
        Path(spec["result"]).write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    _main(sys.argv[1:])
