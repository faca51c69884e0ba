"""The trainer process of one rank: joins its generation's process group, obtains its state
(fresh, retained and repaired in place, or from a checkpoint), and runs iterations with phase
hooks (heartbeat, fault injection) and periodic checkpoints.

Run by the agent as `python -m unbroken.launch.trainer --spec SPEC --rank R --heartbeat ADDR`.
SPEC is the JSON the coordinator writes for each generation (`GenerationSpec`). Exit status:
0 = all iterations done; `FATAL_EXIT` = retained state beyond in-place repair (the coordinator
falls back to checkpoint-restart); anything else is a failure for the agent to report.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

__all__ = ["TRAINER_IMPORTS", "GenerationSpec", "main"]

TRAINER_IMPORTS = [
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch._inductor.config",  # torch.use_deterministic_algorithms imports it (0.7 s)
    "unbroken.checkpoint",
    "unbroken.checkpoint.interval",
    "unbroken.config",
    "unbroken.data",
    "unbroken.detect.timing",
    "unbroken.inject",
    "unbroken.launch.heartbeat",
    "unbroken.launch.restore",
    "unbroken.launch.retained",
    "unbroken.metrics.log",
    "unbroken.recovery",
    "unbroken.state.client",
    "unbroken.train",
    "unbroken.train.build",
    "unbroken.update",
    "unbroken.update.rmu",
    "unbroken.launch.trainer",
]
"""Every module a trainer imports: what level L1 has done (the shadow fork server preloads
these; see unbroken.shadow.forkserver)."""


@dataclass(frozen=True, slots=True)
class GenerationSpec:
    """Everything a trainer of one generation needs (written as JSON by the coordinator)."""

    config: dict[str, Any]
    run_dir: str
    run_name: str
    store_host: str
    store_port: int
    generation: int
    world_size: int
    resume: bool
    search_path: list[str]
    recovery: str = "fresh"
    """fresh (generation 0), inplace, or ckpt_restart."""
    state_sockets: dict[str, str] = field(default_factory=dict)
    """rank -> state manager socket (in-place mode)."""

    def to_json(self) -> str:
        return json.dumps({s: getattr(self, s) for s in self.__slots__}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> GenerationSpec:
        return cls(**json.loads(text))


def _device(cfg) -> Any:
    import torch

    want = cfg.train.device
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    if want == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        return torch.device("cuda", local % max(1, torch.cuda.device_count()))
    return torch.device("cpu")


def steps_footprint(steps: dict[str, float]) -> dict[int, int]:
    """Level -> private bytes measured when the shadow reached it (from `steps`)."""
    return {lv: int(steps[f"bytes-L{lv}"]) for lv in (1, 2, 3) if f"bytes-L{lv}" in steps}


def _await_promotion(
    spec: GenerationSpec, level: int, hb, events, rank: int, t0: float, steps: dict[str, float]
):
    """A shadow trainer parks here, pre-initialized to `level`, until the agent promotes it by
    writing the final spec of its generation to its stdin (Leto §6: in-place preinitialization).
    Returns the final spec."""
    # What this shadow held at each level it passed (what reclaiming it at that level would
    # return): the agent's reclamation controller chooses levels by these.
    footprint = steps_footprint(steps)
    if hb is not None:
        hb.phase = f"shadow-ready-L{level}"
        hb.extra["footprint"] = footprint
        hb.beat()
    events.emit(
        "shadow_ready",
        rank=rank,
        pid=os.getpid(),
        level=level,
        generation=spec.generation,
        prepare_s=time.time() - t0,
        steps_s={k: round(v - t0, 4) for k, v in steps.items() if not k.startswith("bytes")},
        footprint_mb={lv: round(b / (1 << 20), 2) for lv, b in footprint.items()},
    )
    line = sys.stdin.readline()
    if not line:
        raise SystemExit(0)  # the agent let the shadow go
    t_promoted = time.time()
    with contextlib.suppress(OSError):  # back to normal priority (needs privilege to raise it)
        os.setpriority(os.PRIO_PROCESS, 0, 0)
    final = GenerationSpec.from_json(Path(json.loads(line)["spec"]).read_text())
    if final.generation != spec.generation:
        raise RuntimeError(
            f"promoted into generation {final.generation}, prepared {spec.generation}"
        )
    events.emit(
        "shadow_promoted", rank=rank, level=level, generation=spec.generation, t_promoted=t_promoted
    )
    return final


def run(
    spec: GenerationSpec,
    rank: int,
    heartbeat_addr: str | None,
    shadow: int = 0,
    attempt: int = 0,
) -> int:
    t_start = time.time()
    import torch
    import torch.distributed as dist

    from unbroken.config import JobConfig, config_from_dict
    from unbroken.inject import Injector, parse_fault
    from unbroken.launch.heartbeat import Heartbeat
    from unbroken.launch.restore import restore_state
    from unbroken.metrics.log import JsonlLog
    from unbroken.recovery import FATAL_EXIT
    from unbroken.train import Trainer
    from unbroken.train.build import build_training
    from unbroken.update import PlainUpdater

    steps = {"imports": time.time()}  # when each part of the pre-initialization was done
    cfg = config_from_dict(JobConfig, spec.config, "<spec>")
    run_dir = Path(spec.run_dir)
    events = JsonlLog(run_dir / "events.jsonl", run=spec.run_name)
    metrics = JsonlLog(run_dir / "metrics.jsonl", run=spec.run_name) if rank == 0 else None

    hb = None
    if heartbeat_addr:
        hb = Heartbeat(heartbeat_addr, rank, spec.generation, cfg.recovery.heartbeat_interval_s)
        hb.start()
    if shadow:
        from unbroken.shadow.memory import private_bytes

        steps["bytes-L1"] = private_bytes(os.getpid())
    if shadow == 1:  # L1: interpreter up, every import done
        spec = _await_promotion(spec, 1, hb, events, rank, t_start, steps)

    # cuBLAS needs a fixed workspace to be deterministic; set before the first CUDA call.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(cfg.train.threads)
    device = _device(cfg)
    backend = cfg.parallel.backend
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.empty(1, device=device)  # the CUDA context, part of the device runtime (L2)
    if not cfg.data.dataset:
        from unbroken.data import corpus_for

        corpus_for(cfg.data)
    if shadow >= 2 and device.type == "cuda" and cfg.recovery.mode == "inplace":
        from unbroken.shadow.warm import warm_cuda

        warm_cuda(cfg, device)  # library handles and codec kernels, loaded before promotion
        steps["warm"] = time.time()
    steps["runtime"] = time.time()
    if shadow >= 2:
        steps["bytes-L2"] = private_bytes(os.getpid())
    if shadow == 2:  # L2: plus device runtime, threads and the corpus in memory
        spec = _await_promotion(spec, 2, hb, events, rank, t_start, steps)

    timeout = timedelta(seconds=cfg.recovery.collective_timeout_s)
    store = dist.TCPStore(spec.store_host, spec.store_port, is_master=False, timeout=timeout)
    steps["store"] = time.time()
    # Shadows rendezvous under their own prefix: if the agent discards a generation's shadows
    # (one died) and starts fresh processes instead, those must not meet the shadows' keys.
    # A relaunched set of shadows (after a memory reclamation) is a new attempt, a new prefix.
    prefix = f"gen{spec.generation}" + (f"-shadow{attempt}" if shadow else "")
    gen_store = dist.PrefixStore(prefix, store)
    dist.init_process_group(
        backend,
        store=gen_store,
        rank=rank,
        world_size=spec.world_size,
        timeout=timeout,
        device_id=device if device.type == "cuda" else None,
    )
    group = dist.group.WORLD
    t_group = steps["communicators"] = time.time()
    if shadow >= 3:
        steps["bytes-L3"] = private_bytes(os.getpid())
    if shadow == 3:  # L3: plus the communicators of its generation (a mirror world)
        spec = _await_promotion(spec, 3, hb, events, rank, t_start, steps)

    retained = None
    if cfg.recovery.mode == "inplace":
        from unbroken.launch.retained import RetainedState
        from unbroken.state.client import RetainedClient

        retained = RetainedState(cfg, RetainedClient(spec.state_sockets[str(rank)], timeout_s=60))
    job_t0_key = "job/t0"
    if rank == 0 and not store.check([job_t0_key]):
        store.set(job_t0_key, repr(time.time()))
    job_t0 = float(store.get(job_t0_key).decode())
    faults = [parse_fault(f) for f in cfg.inject]
    injector = Injector(faults, rank, store, events.emit, job_t0)
    injector.device = device
    from unbroken.detect.timing import PhaseTimer

    # After the injector: a `slow` stall lands in its own interval. On a GPU it times the work
    # with CUDA events, not the host's enqueueing.
    timer = PhaseTimer(rank, device=device)
    # The heartbeat first: it records the phase a failure (an injected one too) happened in.
    # A plan's worker times itself (its waits are not at phase hooks): no PhaseTimer there.
    hooks = ([hb] if hb else []) + [injector] + ([] if cfg.parallel.planned else [timer])
    autocast = None
    if device.type == "cuda" and cfg.train.precision in ("auto", "bf16"):
        autocast = torch.bfloat16
    if cfg.parallel.planned:
        built, updater, trainer = _build_engine(cfg, group, device, retained, hooks, autocast)
        state = built.state
    else:
        built = build_training(
            cfg,
            n_shards=cfg.parallel.dp,
            device=device,
            search=spec.search_path,
            allocate=retained.allocate if retained else None,
        )
        state = built.state
        if retained is not None:
            from unbroken.update.rmu import ResumableUpdater

            updater = ResumableUpdater(
                state, built.geometry, built.step, retained.tensors(), cfg.protection
            )
        else:
            updater = PlainUpdater(state, built.geometry, built.step)
        trainer = Trainer(
            model=built.model,
            state=state,
            source=built.source,
            shard=rank % cfg.parallel.dp,
            cfg=cfg.train,
            group=group,
            device=device,
            autocast_dtype=autocast,
            hooks=hooks,
            updater=updater,
            loss_fn=built.loss_fn,
        )
    if retained is not None:
        injector.page_loss = retained.page_loss_target(built.geometry)

    outcome = restore_state(
        spec=spec,
        cfg=cfg,
        rank=rank,
        built=built,
        updater=updater,
        retained=retained,
        group=group,
        events=events,
        hook=trainer._hook,
    )
    if outcome is None:
        return FATAL_EXIT
    start_iter, ckpt = outcome
    injector.checkpoint_root = ckpt.root
    if rank == 0:
        events.emit(
            "trainer_ready",
            generation=spec.generation,
            restored_iter=start_iter,
            recovery=spec.recovery,
            group_s=t_group,
        )
    timings = JsonlLog(run_dir / "timings.jsonl", run=spec.run_name)
    iterate = trainer.run_iteration
    if heartbeat_addr and hb is not None and cfg.recovery.shadow_level:
        from unbroken.shadow.client import ReclaimClient

        client = ReclaimClient(heartbeat_addr, rank, spec.generation)
        iterate = _reclaiming(trainer, client, hb, events, rank, device)
    _train_loop(
        cfg,
        spec,
        rank,
        trainer,
        start_iter,
        ckpt,
        store,
        group,
        events,
        metrics,
        timer,
        timings,
        iterate,
    )
    dist.barrier(group=group)
    final_hash = job_state_hash(cfg, state, group)
    if rank == 0:
        events.emit("trainer_done", generation=spec.generation, final_state_hash=final_hash)
    if hb:
        # Tell the agent we are exiting on purpose; it allows the slow teardown of the group.
        hb.phase = "exiting"
        hb.beat()
    dist.destroy_process_group()
    return 0


@dataclass(slots=True)
class _EngineBuilt:
    """What the rest of the trainer uses of a build, for an engine rank."""

    state: Any
    geometry: Any
    reinit: Any
    """Fresh initial parameters in this rank's buffers (its shard of the full model's)."""


def _build_engine(cfg, group, device, retained, hooks, autocast):
    """This rank of the job's plan (`unbroken.engine`) on the retained buffers, as
    (built, updater, worker); the worker has the `Trainer` interface the loop uses."""
    from unbroken.engine.build import build_worker, full_initial_params, plan_from_config
    from unbroken.engine.sharding import load_from_full
    from unbroken.update import PlainUpdater

    plan = plan_from_config(cfg)

    def make_updater(state, geometry, step):
        if retained is None:
            return PlainUpdater(state, geometry, step)
        from unbroken.update.rmu import ResumableUpdater

        return ResumableUpdater(state, geometry, step, retained.tensors(), cfg.protection)

    rank_engine = build_worker(
        cfg,
        plan,
        group,
        device=device,
        allocate=retained.allocate if retained else None,
        hooks=hooks,
        autocast_dtype=autocast,
        make_updater=make_updater,
    )
    worker, state = rank_engine.worker, rank_engine.state
    tp = rank_engine.groups.tp

    def reinit() -> None:
        load_from_full(full_initial_params(cfg), state.layout, state.params, tp.size, tp.rank)

    return _EngineBuilt(state, rank_engine.geometry, reinit), worker.updater, worker


def job_state_hash(cfg, state, group) -> str:
    """The job's model state hash: this rank's when every rank holds all of it (data parallel),
    else a hash over every rank's shard hash in rank order (collective: all ranks call it)."""
    if not cfg.parallel.planned:
        return state.state_hash()
    import hashlib

    import torch.distributed as dist

    hashes: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(hashes, state.state_hash(), group=group)
    return hashlib.sha256("".join(map(str, hashes)).encode()).hexdigest()[:16]


def _reclaiming(trainer, client, hb, events, rank: int, device):
    """`trainer.run_iteration` with Leto's allocation-failure path: an OOM in forward/backward
    (the model state untouched, gradients re-zeroed by the retry) asks the agent to reclaim the
    shadows and computes the iteration again; anything else, or nothing left to reclaim, is
    raised (a crash, recovered in place)."""
    import torch

    def iterate(it: int):
        while True:
            try:
                return trainer.run_iteration(it)
            except (torch.OutOfMemoryError, MemoryError) as exc:
                if hb.iteration != it or hb.phase not in ("forward", "backward"):
                    raise
                used = total = None
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                    free, total = torch.cuda.mem_get_info(device)
                    used = total - free
                t0 = time.time()
                answer = client.request(
                    f"{type(exc).__name__} in {hb.phase}", used, total, iteration=it
                )
                events.emit(
                    "oom_retry",
                    rank=rank,
                    iter=it,
                    phase=hb.phase,
                    reclaimed=answer.get("reclaimed", 0),
                    wait_s=time.time() - t0,
                )
                if not answer.get("reclaimed"):
                    raise

    return iterate


def _train_loop(
    cfg,
    spec,
    rank,
    trainer,
    start_iter,
    ckpt,
    store,
    group,
    events,
    metrics,
    timer,
    timings,
    iterate,
) -> None:
    from unbroken.checkpoint.interval import young_interval

    state = trainer.state
    interval_key = "ckpt/interval"
    interval = cfg.checkpoint.interval or None
    if interval is None and store.check([interval_key]):
        interval = int(store.get(interval_key).decode())
    if cfg.checkpoint.enabled and interval is None and not store.check(["ckpt/cost_s"]):
        # Young's formula needs the checkpoint cost. If no generation measured it yet (the
        # first one failed before), measure it now with a real checkpoint. Every rank checked
        # the store before the save's first barrier and rank 0 sets the key after it, so all
        # ranks take the same branch.
        if not ckpt.cost_s:
            ckpt.cost_s = ckpt.save(state, start_iter, group=group, rank=rank)
            if rank == 0:
                events.emit("checkpoint_saved", iter=start_iter, seconds=ckpt.cost_s)
        if rank == 0:
            store.set("ckpt/cost_s", repr(ckpt.cost_s))
    healthy: list[float] = []
    total = cfg.train.iterations
    if cfg.checkpoint.enabled and interval and 0 < start_iter < total and not start_iter % interval:
        _take_missed_checkpoint(ckpt, state, start_iter, rank, group, events)
    for it in range(start_iter, total):
        result = iterate(it)
        timer.flush()
        healthy.append(result.seconds)
        plan_timing = getattr(trainer, "timing", None)
        if plan_timing is not None and plan_timing.iteration == it:
            # A plan rank: its worker's timings and the micro-batches it computed, by global id.
            timings.write(
                {
                    **plan_timing.to_dict(),
                    "generation": spec.generation,
                    "microbatches": list(result.microbatches),
                    "doc_lengths": [list(x) for x in result.doc_lengths],
                }
            )
        elif timer.records and timer.records[-1].iteration == it:
            # Per-rank compute timings and workload, for fail-slow validation (unbroken.detect).
            timings.write(
                {
                    **timer.records[-1].to_dict(),
                    "generation": spec.generation,
                    "doc_lengths": [list(x) for x in result.doc_lengths],
                }
            )
        ckpt_s = 0.0
        if cfg.checkpoint.enabled:
            if interval is None and len(healthy) >= 3:
                # Young's formula from the measured cost and iteration time; decided by rank 0
                # once, shared through the job store so every rank and generation agrees.
                if rank == 0:
                    cost = float(store.get("ckpt/cost_s").decode())
                    iter_s = sorted(healthy)[len(healthy) // 2]
                    value = young_interval(cost, cfg.checkpoint.mttf_s, iter_s, total)
                    store.set(interval_key, str(value))
                    events.emit(
                        "checkpoint_interval",
                        interval=value,
                        ckpt_cost_s=cost,
                        iter_s=iter_s,
                        mttf_s=cfg.checkpoint.mttf_s,
                    )
                interval = int(store.get(interval_key).decode())
            if interval and (it + 1) % interval == 0 and it + 1 < total:
                ckpt_s = ckpt.save(state, it + 1, group=group, rank=rank)
                if rank == 0:
                    events.emit("checkpoint_saved", iter=it + 1, seconds=ckpt_s)
        # Only rank 0 writes metrics; a plan's hash is a collective every rank joins (the
        # condition is the same on every rank).
        digest = None
        every = cfg.train.hash_every
        hashed = bool(every) and (it % every == 0 or it == total - 1)
        if hashed and (metrics is not None or cfg.parallel.planned):
            digest = job_state_hash(cfg, state, group)
        if metrics is not None:
            t_end = time.time()
            metrics.write(
                {
                    "iter": it,
                    "generation": spec.generation,
                    "t_start": result.t_start,
                    "t_end": t_end,
                    "iter_s": t_end - result.t_start,
                    "loss": result.loss,
                    "grad_norm": result.grad_norm,
                    "lr": result.lr,
                    "tokens": result.tokens,
                    "tokens_per_s": result.tokens / max(1e-9, t_end - result.t_start),
                    "state_hash": digest,
                    "ckpt_s": ckpt_s,
                    "doc_lengths": [list(x) for x in result.doc_lengths],
                }
            )


def _take_missed_checkpoint(ckpt, state, start_iter, rank, group, events) -> None:
    """After an in-place recovery the run resumes at `start_iter`, a checkpoint boundary: its
    checkpoint was due at the end of the iteration the failure interrupted, which
    the recovery finished instead of the loop. Take it now, so the fallback checkpoints keep
    their interval (a restart from a checkpoint resumes at one that exists: nothing to do).
    Rank 0 looks, every rank follows (the save is collective)."""
    import torch.distributed as dist

    missing = [not ckpt.complete(start_iter)] if rank == 0 else [None]
    if group is not None:
        dist.broadcast_object_list(missing, src=0, group=group)
    if missing[0]:
        seconds = ckpt.save(state, start_iter, group=group, rank=rank)
        if rank == 0:
            events.emit("checkpoint_saved", iter=start_iter, seconds=seconds, missed=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="unbroken-trainer")
    parser.add_argument("--spec", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--heartbeat", default=None)
    parser.add_argument(
        "--shadow", type=int, default=0, choices=(0, 1, 2, 3), help="pre-initialize to this level"
    )
    parser.add_argument(
        "--attempt", type=int, default=0, help="shadows: which set for this generation"
    )
    parser.add_argument(
        "--local-rank",
        type=int,
        default=None,
        help="this rank's index on its node: its GPU is cuda:(local-rank %% device count)",
    )
    args = parser.parse_args(argv)
    if args.local_rank is not None:
        os.environ["LOCAL_RANK"] = str(args.local_rank)
    spec = GenerationSpec.from_json(Path(args.spec).read_text())
    try:
        code = run(spec, args.rank, args.heartbeat, shadow=args.shadow, attempt=args.attempt)
        # Everything this process reports is already written with unbuffered os.write; skip the
        # interpreter and gloo teardown (0.8-1.8 s measured) that would only delay the exit.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    except Exception as exc:  # the agent reports the exit; keep the reason on stderr
        from unbroken.errors import UserError

        kind = "error" if isinstance(exc, UserError) else type(exc).__name__
        print(f"unbroken-trainer[rank {args.rank}]: {kind}: {exc}", file=sys.stderr)
        if os.environ.get("UNBROKEN_DEBUG"):
            raise
        sys.stderr.flush()
        os._exit(1)  # exit now: a failed rank must be noticed without waiting for teardown


if __name__ == "__main__":
    raise SystemExit(main())
