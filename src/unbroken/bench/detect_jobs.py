"""Real short data-parallel training jobs for `unbroken bench detect`, timed per rank.

`run_jobs` starts `world_size` worker processes once (gloo over a TCPStore, one CPU thread
each; with `device="cuda"` NCCL, rank r on GPU r, bf16 autocast, CUDA-event timings) and runs
the jobs one after another in them: each job builds a fresh model, state and
sampler (`build_training`) from its own seeds, trains for real on the stdlib corpus with
variable-length packing (`varlen_loss`), and fires its faults through the project's own
`unbroken.inject.Injector` (a `slow` fault really sleeps). A `PhaseTimer` after the injector
records every rank's compute timings. Reusing the processes only saves the ~5 s process and
group start per job; nothing carries over between jobs but the warm allocator.

`run_job`/the coordinator cannot carry the timer hook (the trainer's hook list is fixed in
`unbroken.launch.trainer`), hence this runner. Each rank writes `job{j}-rank{r}.jsonl` (one
line per iteration: `iter`, `t_start`, `t_end`, `doc_lengths`, and the `RankTiming` fields);
injections go to `events.jsonl`.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path

from unbroken.bench.ranks import run_ranks

__all__ = ["BenchJob", "BenchSetup", "run_jobs"]


@dataclass(kw_only=True, slots=True)
class BenchSetup:
    """The training jobs' shape (the same for every job)."""

    world_size: int = 2
    """Data-parallel ranks (processes)."""
    tokens_per_microbatch: int = 2048
    """Token budget N of a packed micro-batch."""
    microbatches: int = 3
    """Micro-batches per rank per iteration (all but the last are timed cleanly)."""
    iterations: int = 40
    """Iterations per job."""
    preset: str = "tiny"
    """Reference model preset (`unbroken.model.PRESETS`)."""
    n_layers: int | None = 1
    """Layers (None: the preset's; 1 by default, the cheapest model on CPU)."""
    n_heads: int | None = 1
    """Attention heads, also the KV heads (None: the preset's; one head of 64 by default: the
    cheapest attention per token pair on CPU)."""
    device: str = "cpu"
    """cpu (gloo) or cuda (NCCL, one GPU per rank)."""
    workload: str = "iid"
    """iid: documents drawn independently every iteration; phases: `unbroken.bench.detect_phases`
    (runs of iterations with short documents)."""
    phase_iters: int = 6
    """phases: iterations per phase."""
    short_tokens: int = 128
    """phases: longest segment in a short-document phase."""
    threads: int = 1
    """Torch threads per rank."""
    pin_cpus: int = -1
    """Pin rank r to CPU pin_cpus + r (-1: no pinning; the OS may migrate ranks)."""

    def __post_init__(self) -> None:
        if self.world_size < 2:
            raise ValueError("bench: world_size must be >= 2 (validation compares ranks)")
        if self.microbatches < 2:
            raise ValueError("bench: microbatches must be >= 2 (the last one is not timed)")
        if self.iterations < 20:
            raise ValueError("bench: iterations must be >= 20")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"bench: device must be cpu or cuda, not {self.device!r}")
        if self.workload not in ("iid", "phases"):
            raise ValueError(f"bench: workload must be iid or phases, not {self.workload!r}")
        if self.phase_iters < 1 or self.short_tokens < 1:
            raise ValueError("bench: phase_iters and short_tokens must be >= 1")

    def describe(self) -> str:
        """The model, as the report names it."""
        layers = "preset layers" if self.n_layers is None else f"{self.n_layers} layer(s)"
        heads = "preset heads" if self.n_heads is None else f"{self.n_heads} head(s)"
        kernel = "FlashAttention varlen, bf16" if self.device == "cuda" else "SDPA per doc length"
        shape = f"{self.preset}, {layers}, {heads}, {kernel}, {self.device}"
        if self.workload == "phases":
            shape += f"; phases of {self.phase_iters} iterations, short <= {self.short_tokens}"
        return shape


@dataclass(kw_only=True, slots=True)
class BenchJob:
    index: int
    seed: int
    """Model and data seed of this job."""
    faults: list[str] = field(default_factory=list)
    """Fault specs (`unbroken.inject` syntax)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _job_config(setup: BenchSetup, job: BenchJob):
    from unbroken.config import (
        CheckpointConfig,
        DataConfig,
        JobConfig,
        ModelConfig,
        ParallelConfig,
        ProtectionConfig,
        TrainConfig,
    )

    return JobConfig(
        model=ModelConfig(
            preset=setup.preset,
            n_layers=setup.n_layers,
            n_heads=setup.n_heads,
            n_kv_heads=setup.n_heads,
        ),
        data=DataConfig(
            tokens_per_microbatch=setup.tokens_per_microbatch,
            microbatches=setup.microbatches,
            seed=job.seed,
        ),
        train=TrainConfig(
            iterations=setup.iterations, lr=1e-3, seed=job.seed, threads=setup.threads
        ),
        parallel=ParallelConfig(world_size=setup.world_size),
        checkpoint=CheckpointConfig(enabled=False),
        # GPU: 2 MiB pages, 80-page stripes and 256 KiB update chunks, the geometry of the runs
        # in bench/results/detect-h200.md (kept so they reproduce; the device default since,
        # `PROTECTION_DEFAULTS`, has 8-page stripes and 512 KiB chunks).
        protection=ProtectionConfig(page_bytes=2 << 20, stripe_pages=80, chunk_bytes=256 << 10)
        if setup.device == "cuda"
        else ProtectionConfig(),
        inject=list(job.faults),
    )


def _worker(rank: int, setup: dict, jobs: list[dict], out: str, port: int) -> None:
    import torch
    import torch.distributed as dist

    s = BenchSetup(**setup)
    if s.pin_cpus >= 0:
        os.sched_setaffinity(0, {(s.pin_cpus + rank) % (os.cpu_count() or 1)})
    torch.set_num_threads(s.threads)
    # Not deterministic: that mode disables the CPU flash-attention kernel of SDPA, and the
    # bench measures time, not bit-exactness.
    store = dist.TCPStore(
        "127.0.0.1", port, s.world_size, is_master=rank == 0, timeout=timedelta(seconds=120)
    )
    cuda = s.device == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        store=dist.PrefixStore("group", store),
        rank=rank,
        world_size=s.world_size,
        timeout=timedelta(seconds=300),
        **({"device_id": device} if cuda else {}),
    )
    for spec in jobs:
        _run_job(rank, s, BenchJob(**spec), len(jobs), store, device, Path(out))
    dist.destroy_process_group()


def _run_job(
    rank: int, s: BenchSetup, job: BenchJob, n_jobs: int, store, device, out: Path
) -> None:
    """Train one job on this rank and log every iteration's timings."""
    import torch.distributed as dist

    from unbroken.metrics.log import JsonlLog

    events = JsonlLog(out / "events.jsonl", run=f"job{job.index}")
    log = JsonlLog(out / f"job{job.index}-rank{rank}.jsonl")
    trainer, timer = _trainer(rank, s, job, store, device, events)
    t0 = time.time()
    for it in range(s.iterations):
        res = trainer.run_iteration(it)
        timer.flush()  # CUDA: the iteration's events become its record
        rec = timer.records[-1]
        log.write(
            {
                "iter": it,
                "t_start": res.t_start,
                "t_end": res.t_end,
                "doc_lengths": [list(d) for d in res.doc_lengths],
                "loss": res.loss,
            }
            | rec.to_dict()
        )
    log.close()
    events.close()
    dist.barrier()
    if rank == 0:
        wall = time.time() - t0
        print(
            f"  job {job.index + 1}/{n_jobs}: {s.iterations} iterations in {wall:.1f} s"
            f" ({wall / s.iterations:.3f} s/iter), faults: {', '.join(job.faults) or '-'}",
            file=sys.stderr,
            flush=True,
        )


def _trainer(rank: int, s: BenchSetup, job: BenchJob, store, device, events):
    """(trainer, its timer hook) of one job on this rank: fresh model, state and sampler from
    the job's seeds, the injector firing the job's faults (recorded to `events`), then the
    timer, and the per-document loss."""
    import torch
    import torch.distributed as dist

    from unbroken.bench.detect_phases import PhasedSource
    from unbroken.bench.detect_varlen import varlen_loss
    from unbroken.detect.timing import PhaseTimer
    from unbroken.engine.replica import build_training
    from unbroken.inject import Injector, parse_fault
    from unbroken.jobstore import JobStore
    from unbroken.train import Trainer
    from unbroken.update import PlainUpdater

    cfg = _job_config(s, job)
    built = build_training(cfg, n_shards=s.world_size, device=device)
    source = built.source
    if s.workload == "phases":
        source = PhasedSource(source, job.seed, s.phase_iters, s.short_tokens)
    injector = Injector(
        [parse_fault(f) for f in job.faults],
        rank,
        JobStore(dist.PrefixStore(f"job{job.index}", store)),
        events.emit,
        time.time(),
    )
    injector.device = device
    timer = PhaseTimer(rank=rank, device=device)
    trainer = Trainer(
        model=built.model,
        state=built.state,
        source=source,
        shard=rank,
        cfg=cfg.train,
        group=dist.group.WORLD,
        device=device,
        autocast_dtype=torch.bfloat16 if device.type == "cuda" else None,
        hooks=[injector, timer],
        updater=PlainUpdater(built.state, built.geometry, built.step),
        loss_fn=varlen_loss,
    )
    return trainer, timer


def run_jobs(setup: BenchSetup, jobs: list[BenchJob], out: Path) -> None:
    """Run `jobs` in `setup.world_size` fresh processes; per-rank logs land under `out`.

    Workers are `python -m unbroken.bench.detect_jobs SPEC RANK` processes (not multiprocessing's
    spawn, which re-runs the caller's `__main__` and breaks under `python -m unbroken`).

    Raises:
        RuntimeError: a worker process failed.
        ValueError: `setup.device` is cuda and there are fewer GPUs than ranks.
    """
    if setup.device == "cuda":
        import torch

        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if have < setup.world_size:
            raise ValueError(
                f"bench: {setup.world_size} ranks need {setup.world_size} GPUs (one per rank; "
                f"NCCL refuses two ranks on one GPU); this machine has {have}"
            )
    out.mkdir(parents=True, exist_ok=True)
    for old in [*out.glob("job*-rank*.jsonl"), out / "events.jsonl"]:
        old.unlink(missing_ok=True)
    spec = out / "bench-spec.json"
    spec.write_text(
        json.dumps(
            {
                "setup": asdict(setup),
                "jobs": [asdict(j) for j in jobs],
                "out": str(out),
                "port": _free_port(),
            }
        )
    )
    run_ranks(
        "unbroken.bench.detect_jobs", [str(spec)], setup.world_size, setup.threads, "bench worker"
    )


def _main(argv: list[str]) -> None:
    spec = json.loads(Path(argv[0]).read_text())
    _worker(int(argv[1]), spec["setup"], spec["jobs"], spec["out"], spec["port"])


if __name__ == "__main__":
    _main(sys.argv[1:])
