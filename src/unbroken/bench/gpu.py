"""`unbroken bench gpu`: the in-place recovery figures of issue 16 on one GPU, in one run.

In one process on one CUDA device, with the trainer's own code (`Trainer`, `PlainUpdater`,
`ResumableUpdater` on local device regions, DCP checkpoints) and the trainers' settings
(deterministic algorithms, bf16 autocast over fp32 master weights):

- step: iterations of the reference model (`--preset`, `--microbatches` x `--tokens`), eager
  and, with `--compile`, with `compile_blocks`, and with `--cuda-graphs` with the compiled
  blocks replayed as CUDA graphs (the best is reported; compiling cannot be undone, so the
  later figures run in the last mode timed, the protected trainer's too); MFU = model FLOPs /
  (iteration time x peak); `--profile-step FILE` adds where the best step's time goes
  (`unbroken.bench.gpu_profile`: device busy and idle, gaps, host operations, device time by
  kernel family);
- update: the plain (fused) update and the resumable update of the same state, timed alone
  (device synchronized around each), and the iteration overhead of protection at the step's
  shape and at a Leto-shaped one (micro-batches added until compute is >= 100x the plain
  update), plain and protected iterations alternated (ABBA);
- HBM: protection's device memory (parity, undo, scratch, marker) over the retained state;
- checkpoints: the blocking part of an asynchronous DCP save (first, with pinned staging
  allocated, and steady), its time to completion, iterations run while it writes, and the
  restart path (find the newest valid checkpoint, load it), with a bit-exact round trip.

[Note: MFU formula] model FLOPs of one iteration = 6 N tokens + 6 L d sum_docs(l^2): N the
parameters in matrix products (all but the embedding table), L layers, d the model width, l
the document lengths — attention is causal within documents, so its forward costs 2 d l^2 per
layer and document and its backward twice that. Peak: `--peak-tflops` (989, the H100/H200
dense bf16 datasheet figure). `mfu_full_causal` also reports the common 6 N + 6 L d T per
token (attention over the whole T-token window), for comparison with other reports.

Recovery times of real jobs (`l3_recovery_s`, `ckpt_restart_s`) and the external kill
campaign are not measured here yet: the result says so (null), it never estimates them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["add_arguments", "run"]


# Long: one statement per option of the bench, nothing to split.
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="1b", help="model preset (default 1b)")
    p.add_argument("--tokens", type=int, default=4096, help="tokens per micro-batch")
    p.add_argument(
        "--tokenizer",
        default="auto",
        help="data.tokenizer (auto: the preset's; the H200 record of 2026-12-01 used bytes)",
    )
    p.add_argument("--microbatches", type=int, default=8, help="micro-batches per iteration")
    p.add_argument("--iterations", type=int, default=6, help="timed iterations per variant")
    p.add_argument("--compile", action="store_true", help="also time compile_blocks")
    p.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="also time compile_blocks(cuda_graphs=True): each block's forward and backward "
        "replayed as CUDA graphs (after --compile's figure when both are given)",
    )
    p.add_argument(
        "--kernels", default="varlen,flex", help="attention kernels to time (default varlen,flex)"
    )
    p.add_argument(
        "--fill-uninitialized",
        action="store_true",
        help="keep torch's NaN fill of new allocations under deterministic algorithms",
    )
    p.add_argument("--no-rmu", action="store_true", help="skip the resumable updater")
    p.add_argument("--no-ckpt", action="store_true", help="skip the checkpoint figures")
    p.add_argument("--ckpt-dir", default=None, help="checkpoint root (default: a temp dir)")
    p.add_argument("--peak-tflops", type=float, default=989.0)
    p.add_argument(
        "--device", default="cuda", help="cuda (default); cpu only smoke-tests the harness"
    )
    p.add_argument(
        "--rmu-geometries",
        default="",
        help="also time the resumable update at these geometries: comma-separated "
        "STRIPE:CHUNK_BYTES:H1[:CODE] (2 MiB pages, H2 = 1; CODE cauchy or vandermonde, "
        "default: the device's choice for H1, protection.code = auto)",
    )
    p.add_argument(
        "--protection-code",
        default="auto",
        choices=("auto", "cauchy", "vandermonde"),
        help="protection.code: the first tier's generator (auto: three Vandermonde pages on a "
        "GPU, computed by Horner's rule in the fused update; cauchy: four Cauchy pages)",
    )
    p.add_argument(
        "--parity-memory",
        default="host",
        choices=("host", "device"),
        help="protection.parity_memory: the model's parity in pinned host memory (default, "
        "Leto §4) or in HBM",
    )
    p.add_argument(
        "--rmu-kind",
        default="auto",
        choices=("auto", "unfused", "stream", "host"),
        help="the resumable updater timed (unbroken.update.factory; auto: the graph-replayed "
        "one where it applies)",
    )
    p.add_argument(
        "--jobs",
        action="store_true",
        help="also run real jobs (L3 shadow; checkpoint-restart) with a kill in the update "
        "and one in the backward pass, for l3_recovery_s and ckpt_restart_s",
    )
    p.add_argument("--jobs-out", default=None, help="run dirs of --jobs (default: a temp dir)")
    p.add_argument(
        "--jobs-modes",
        default="L3,ckpt_restart",
        help="the --jobs to run, comma-separated: L3 (in place, L3 shadow), ckpt_restart",
    )
    p.add_argument(
        "--shadow-warmup",
        default="at_start",
        choices=("after_trainer", "at_start"),
        help="recovery.shadow_warmup of the L3 job: a shadow's GPU warm-up at once (default, "
        "as the config's) or after its trainer's first iteration",
    )
    p.add_argument(
        "--kill-trials",
        type=int,
        default=0,
        help="external random-time SIGKILL campaign (unbroken.bench.kills): trials on "
        "--kill-preset, in place through an L3 shadow",
    )
    p.add_argument("--kill-preset", default="125m", help="model of the kill campaign")
    p.add_argument(
        "--kill-tokens",
        type=int,
        default=2048,
        help="tokens per micro-batch of the kill campaign's job (fewer: the update is a larger "
        "share of each iteration, so more kills land inside it)",
    )
    p.add_argument(
        "--kill-microbatches", type=int, default=4, help="micro-batches of the campaign's job"
    )
    p.add_argument(
        "--kills-per-run",
        type=int,
        default=1,
        help="kills in each run of the campaign, each after the previous one's recovery",
    )
    p.add_argument("--kill-seed", type=int, default=0, help="seed of the kill times")
    p.add_argument(
        "--kill-async-ckpt",
        action="store_true",
        help="the campaign's job saves its checkpoints asynchronously (checkpoint.asynchronous): "
        "with synchronous saves most uniformly drawn kills land inside a save (stop 46: 28 of "
        "30), whose redo then dominates the recovery",
    )
    p.add_argument(
        "--kill-aim-ms",
        type=float,
        default=None,
        help="aim the campaign's kills at the update: uniformly within this many ms before "
        "the predicted end of an iteration (default: uniform over the run)",
    )
    p.add_argument(
        "--update-only",
        action="store_true",
        help="only the update phase: plain and resumable updater variants on random gradients "
        "(unbroken.bench.gpu_update)",
    )
    p.add_argument(
        "--update-variants",
        default="unfused,auto",
        help="with --update-only: factory kinds (auto, unfused, stream) or "
        "fused:PLANES:BLOCK:WARPS, comma-separated",
    )
    p.add_argument(
        "--profile-update",
        default=None,
        help="with --update-only: device time per kernel of one update per variant, to this file",
    )
    p.add_argument(
        "--profile-step",
        default=None,
        help="after the step figures, profile 2 iterations of the best step: device busy and "
        "idle time, gaps and device ms by kernel family (JSON 'step_profile'), the kernel "
        "table to this file (unbroken.bench.gpu_profile)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _say(text: str) -> None:
    print(f"[gpu] {text}", file=sys.stderr, flush=True)


def _with_protection(cfg, stripe: int, chunk: int, h1: int, code: str = "auto"):
    from unbroken.config import ProtectionConfig

    prot = ProtectionConfig(
        page_bytes=2 << 20,
        stripe_pages=stripe,
        chunk_bytes=chunk,
        parity_pages=h1,
        code=code,
        second_tier_pages=1,
        parity_memory=cfg.protection.parity_memory,
    ).resolved(cuda=True)
    return dataclasses.replace(cfg, protection=prot)


def _geometry_sweep(cfg, device, init, spec: str, kernel: str, mode: str, kind: str) -> list[dict]:
    """The resumable update alone at other protection geometries (same state, same data)."""
    import torch

    out = []
    for item in (x for x in spec.split(",") if x):
        stripe, chunk, h1, *code = item.split(":")
        stripe, chunk, h1 = int(stripe), int(chunk), int(h1)
        gcfg = _with_protection(cfg, stripe, chunk, h1, *code)
        tr, upd, _, regions, geometry = _build(
            gcfg, device, protected=True, init_from=init, mode=mode, kind=kind
        )
        tr.model.attention_kernel = kernel
        for it in range(4):
            tr.run_iteration(it)
        row = {
            "stripe_pages": stripe,
            "chunk_bytes": chunk,
            "parity_pages": h1,
            "code": gcfg.protection.code,
            "chunks": len(geometry.chunks()),
            "rmu_update_ms": 1e3 * statistics.median(upd.update_s[1:]),
            "rmu_first_update_ms": 1e3 * upd.update_s[0],
            "rmu_capture_ms": 1e3 * getattr(upd.inner, "capture_s", 0.0),
            "rmu_protect_ms": 1e3 * statistics.median(upd.protect_s[1:]),
        }
        row.update(_hbm(regions, geometry, upd.inner.staging_bytes))
        out.append(row)
        _say(
            f"geometry {item}: update {row['rmu_update_ms']:.1f} ms, HBM +{row['hbm_overhead_pct']:.1f} %"
        )
        del tr, upd, regions
        torch.cuda.empty_cache()
    return out


_KILLS = ("kill:rank=0,iter=4,phase=update", "kill:rank=0,iter=6,phase=backward")


def _repairs(run_dir: Path) -> list[dict[str, Any]]:
    """The job's `inplace_repair` events (fix-up, marker found, ms by step)."""
    from unbroken.metrics.log import read_jsonl

    events = run_dir / "events.jsonl"
    if not events.exists():
        return []
    return [e for e in read_jsonl(events) if e.get("kind") == "inplace_repair"]


def _jobs(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """Real jobs (`unbroken.api.run_job`, one rank on this GPU): the same two kills recovered
    in place through an L3 shadow and by checkpoint-restart; recovery totals per failure."""
    from unbroken.api import run_job
    from unbroken.config import CheckpointConfig, RecoveryConfig

    base = _job(args, args.microbatches)
    base = dataclasses.replace(
        base,
        train=dataclasses.replace(base.train, iterations=8),
        checkpoint=CheckpointConfig(interval=3, keep=2),
    )
    res: dict[str, Any] = {
        "kills": list(_KILLS),
        "iterations": 8,
        "checkpoint_interval": 3,
        "shadow_warmup": args.shadow_warmup,
    }
    ref_hash = None
    modes = {"L3": ("inplace", 3), "ckpt_restart": ("ckpt_restart", 0)}
    wanted = [m.strip() for m in args.jobs_modes.split(",") if m.strip()]
    if unknown := [m for m in wanted if m not in modes]:
        raise SystemExit(f"--jobs-modes: unknown {unknown} (choose from {sorted(modes)})")
    for name in wanted:
        mode, level = modes[name]
        rec = RecoveryConfig(mode=mode, shadow_level=level, shadow_warmup=args.shadow_warmup)
        cfg = dataclasses.replace(base, recovery=rec, inject=list(_KILLS))
        t0 = time.time()
        _say(f"job {name}")
        summary = run_job(cfg, out / name, reference=ref_hash is None, quiet=True)
        ref_hash = ref_hash or summary.get("reference_state_hash")
        recs = summary.get("recoveries", [])
        res[name] = {
            "state": summary.get("state"),
            "bit_exact": summary.get("final_state_hash") == ref_hash,
            "recovery_s": [r.get("total_s") for r in recs],
            "recoveries": recs,
            "repairs": _repairs(out / name),
            "lent_peak": _lent_peak(out / name),
            **_takeovers(out / name),
            "wall_s": time.time() - t0,
        }
        _say(  # logged per job: a call's time limit may cut the next one and the JSON
            f"job {name}: {res[name]['state']}, bit-exact {res[name]['bit_exact']}, "
            f"recoveries {res[name]['recovery_s']}, lent peak {res[name]['lent_peak']}, "
            f"repairs {[(e.get('fixup'), e.get('total_ms')) for e in res[name]['repairs']]}"
        )
        # A 1b checkpoint is 11.4 GB and each job keeps two (its reference run too): the next
        # job's saves ran out of the H200 machine's 64 GiB disk before these were deleted.
        for ckpt in sorted((out / name).rglob("checkpoints")):
            shutil.rmtree(ckpt, ignore_errors=True)
    return res


def _takeovers(run_dir: Path) -> dict[str, Any]:
    """Per recovered generation: its attach (`trainer_ready`: `attach_s`, `map_s`, regions
    found `premapped`, `build_s`) and its first iteration's time beside the job's steady one
    (the median of every iteration but each generation's first), both without the blocked
    time of a checkpoint saved in the iteration (`ckpt_s`); `first_iteration_saved` says
    which first iterations saved one (the rest of a save's cost is still in them)."""
    import statistics

    from unbroken.metrics.log import read_jsonl

    events = run_dir / "events.jsonl"
    metrics = run_dir / "metrics.jsonl"
    if not events.exists() or not metrics.exists():
        return {}
    keys = ("generation", "attach_s", "map_s", "premapped", "restore_s", "build_s")
    ready = [
        {k: e.get(k) for k in keys}
        for e in read_jsonl(events)
        if e["kind"] == "trainer_ready" and e["generation"] > 0
    ]
    rows = read_jsonl(metrics)
    first: dict[int, dict] = {}
    for r in rows:
        first.setdefault(r["generation"], r)

    def net(r: dict) -> float:
        return r["iter_s"] - r.get("ckpt_s", 0.0)

    later = [net(r) for r in rows if first[r["generation"]] is not r]
    recovered = [first[g] for g in sorted(first) if g > 0]
    second = {}
    for r in rows:
        if r["generation"] > 0 and first[r["generation"]] is not r:
            second.setdefault(r["generation"], r)
    return {
        "attach": ready,
        "attach_s": [r["attach_s"] for r in ready],
        "first_iteration_s": [net(r) for r in recovered],
        # The one after it: where the successor shadows' warm-up goes (recovery.shadow_warmup).
        "second_iteration_s": [net(second[g]) for g in sorted(second)],
        "first_iteration_saved": [r.get("ckpt_s", 0.0) > 0 for r in recovered],
        "steady_iteration_s": statistics.median(later) if later else None,
    }


def _lent_peak(run_dir: Path) -> list[int]:
    """`lent_peak` of the job's metrics rows (bytes of the lent buffers its activations held)."""
    from unbroken.metrics.log import read_jsonl

    rows = [] if not (run_dir / "metrics.jsonl").exists() else read_jsonl(run_dir / "metrics.jsonl")
    return sorted({r["lent_peak"] for r in rows if "lent_peak" in r})


def kill_config(args: argparse.Namespace):
    """The kill campaign's job: `--kill-preset` on one rank, in place through an L3 shadow,
    a checkpoint every 4 iterations (asynchronous with `--kill-async-ckpt`)."""
    from unbroken.config import CheckpointConfig, RecoveryConfig

    kargs = argparse.Namespace(**{**vars(args), "preset": args.kill_preset})
    cfg = _job(kargs, args.kill_microbatches)
    return dataclasses.replace(
        cfg,
        data=dataclasses.replace(cfg.data, tokens_per_microbatch=args.kill_tokens),
        train=dataclasses.replace(cfg.train, iterations=12 + 6 * (args.kills_per_run - 1)),
        checkpoint=CheckpointConfig(interval=4, asynchronous=args.kill_async_ckpt),
        recovery=RecoveryConfig(mode="inplace", shadow_level=3),
    )


def _kills(args: argparse.Namespace) -> dict[str, Any]:
    """The external kill campaign on a GPU job of `--kill-preset` (one rank, L3 shadow)."""
    from unbroken.bench.kills import run_campaign

    root = Path(tempfile.mkdtemp(prefix="unbroken-kills-"))
    return run_campaign(
        kill_config(args),
        root,
        trials=args.kill_trials,
        seed=args.kill_seed,
        kills_per_run=args.kills_per_run,
        aim_s=None if args.kill_aim_ms is None else args.kill_aim_ms / 1e3,
        say=_say,
    )


def _job(args: argparse.Namespace, microbatches: int):
    from unbroken.config import (
        DataConfig,
        JobConfig,
        ModelConfig,
        ParallelConfig,
        ProtectionConfig,
        TrainConfig,
    )

    cuda = args.device == "cuda"
    return JobConfig(
        model=ModelConfig(preset=args.preset),
        protection=ProtectionConfig(
            parity_memory=getattr(args, "parity_memory", "host"),
            code=getattr(args, "protection_code", "auto"),
        ),
        parallel=ParallelConfig(world_size=1),  # one rank on this GPU
        data=DataConfig(
            tokens_per_microbatch=args.tokens,
            microbatches=microbatches,
            tokenizer=getattr(args, "tokenizer", "auto"),
        ),
        train=TrainConfig(
            iterations=1000,
            lr=3e-4,
            device="cuda" if cuda else "cpu",
            precision="bf16" if cuda else "fp32",
        ),
    )


def _sync() -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class _TimedUpdater:
    """Delegates to an updater; times `update` alone, the device synchronized around it."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.lending = getattr(inner, "lending", None)
        self.update_s: list[float] = []
        self.protect_s: list[float] = []

    def protect(self, iteration: int) -> None:
        _sync()
        t0 = time.perf_counter()
        self.inner.protect(iteration)
        _sync()
        self.protect_s.append(time.perf_counter() - t0)

    def record_sync(self, iteration: int, **stats: float) -> None:
        self.inner.record_sync(iteration, **stats)

    def update(self, iteration: int, **kwargs: Any) -> None:
        _sync()
        t0 = time.perf_counter()
        self.inner.update(iteration, **kwargs)
        _sync()
        self.update_s.append(time.perf_counter() - t0)

    def boundary(self, iteration: int) -> None:
        self.inner.boundary(iteration)


def _plain(init_from):
    """The plain trainer's state allocator: fresh parameters unless given."""

    def allocate(layout, geometry, dev):
        from unbroken.train.state import TrainState

        st = TrainState.allocate(layout, dev, geometry.padded_numel)
        return st, init_from is None

    return allocate


def _build(
    cfg,
    device,
    *,
    protected: bool,
    init_from=None,
    mode: str = "eager",
    kind: str = "auto",
    lend: bool = False,
):
    """A Trainer on `device` with the plain or the resumable updater (local device regions);
    `lend`: its compute phase borrows the updater's buffers (`unbroken.update.lending`: one
    lending trainer per process, never with the ``graphs`` mode's private pools)."""
    import torch

    from unbroken.engine.replica import build_training, state_geometry
    from unbroken.model import compile_blocks
    from unbroken.train import Trainer
    from unbroken.update import PlainUpdater
    from unbroken.update.factory import resumable_updater
    from unbroken.update.rmu import local_allocator

    regions: dict[str, torch.Tensor] = {}

    if lend and mode == "graphs":
        raise ValueError("bench gpu: the graphs mode's CUDA graphs cannot lend activations")
    prot = dataclasses.replace(
        cfg.protection.resolved(device.type == "cuda"), lend_activations=lend
    )
    allocate = local_allocator(prot, regions, fresh=init_from is None)

    built = build_training(
        cfg, n_shards=1, device=device, allocate=allocate if protected else _plain(init_from)
    )
    if init_from is not None:  # the same initial parameters (padding differs by geometry)
        n = built.state.layout.numel
        built.state.params[:n].copy_(init_from[:n])
    if protected:
        inner = resumable_updater(built.state, built.geometry, built.step, regions, prot, kind=kind)
        inner.initialize(-1)
    else:
        inner = PlainUpdater(built.state, built.geometry, built.step)
    if mode != "eager":  # "compiled", or "graphs" (compiled blocks replayed as CUDA graphs)
        compile_blocks(built.model, cuda_graphs=mode == "graphs")
    upd = _TimedUpdater(inner)
    trainer = Trainer(
        model=built.model,
        state=built.state,
        source=built.source,
        shard=0,
        cfg=cfg.train,
        group=None,
        device=device,
        autocast_dtype=torch.bfloat16 if device.type == "cuda" else None,
        updater=upd,
    )
    geometry = state_geometry(cfg, built.state.layout.numel, device.type == "cuda")
    return trainer, upd, built, regions, geometry


def _model_flops(model, results) -> tuple[float, float]:
    """(documents-causal FLOPs, full-window causal FLOPs) of the iterations in `results`."""
    a = model.args
    n_matrix = sum(p.numel() for name, p in model.named_parameters() if "embed" not in name)
    docs = full = 0.0
    for r in results:
        tokens = sum(sum(lens) for lens in r.doc_lengths)
        attn_docs = sum(n * n for lens in r.doc_lengths for n in lens)
        attn_full = sum(sum(lens) ** 2 for lens in r.doc_lengths)
        docs += 6 * n_matrix * tokens + 6 * a.n_layers * a.dim * attn_docs
        full += 6 * n_matrix * tokens + 6 * a.n_layers * a.dim * attn_full
    return docs, full


def _attention_figures(trainer, kernels: list[str]) -> dict[str, Any]:
    """Forward + backward of one layer's attention on the first micro-batch's documents, per
    kernel: device time (CUDA events, median of 20) and whether two backward passes give the
    same bits under deterministic algorithms."""
    import torch

    from unbroken.model.attention import Documents, document_attention

    a = trainer.model.args
    mb = trainer.source.iteration(0, 0)[0]
    seg = mb.segment_ids.to("cuda")
    t = seg.numel()
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape_q, shape_kv = (t, a.n_heads, a.head_dim), (t, a.n_kv_heads, a.head_dim)
    q0 = torch.randn(shape_q, device="cuda", dtype=torch.bfloat16, generator=gen)
    k0 = torch.randn(shape_kv, device="cuda", dtype=torch.bfloat16, generator=gen)
    v0 = torch.randn(shape_kv, device="cuda", dtype=torch.bfloat16, generator=gen)
    dout = torch.randn(shape_q, device="cuda", dtype=torch.bfloat16, generator=gen)
    out: dict[str, Any] = {"doc_lengths": list(mb.doc_lengths)}
    for kernel in kernels:
        docs = Documents.of(mb.doc_lengths, seg, kernel)

        def once(docs=docs):
            q, k, v = (x.clone().requires_grad_() for x in (q0, k0, v0))
            document_attention(q, k, v, docs).backward(dout)
            return q.grad, k.grad, v.grad

        g1, g2 = once(), once()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(20):
            start.record()
            once()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        out[kernel] = {
            "fwd_bwd_ms": statistics.median(times),
            "deterministic": all(torch.equal(x, y) for x, y in zip(g1, g2, strict=True)),
        }
    return out


def _time_step(trainer, iterations: int, first: int) -> list:
    out = []
    for it in range(first, first + iterations):
        out.append(trainer.run_iteration(it))
    return out


def _step_figures(trainer, results, peak: float) -> dict[str, Any]:
    secs = [r.seconds for r in results]
    docs, full = _model_flops(trainer.model, results)
    per_iter = statistics.median(secs)
    n = len(results)
    return {
        "iteration_s": per_iter,
        "iteration_s_all": secs,
        "tokens": results[0].tokens,
        "model_tflop_per_iter": docs / n / 1e12,
        "mfu": docs / n / per_iter / (peak * 1e12),
        "mfu_full_causal": full / n / per_iter / (peak * 1e12),
    }


def _overhead(plain, rmu, iterations: int, first: int) -> dict[str, Any]:
    """Plain and protected iterations alternated (ABBA); medians and the overhead."""
    times: dict[str, list[float]] = {"plain": [], "rmu": []}
    pairs = [("plain", plain), ("rmu", rmu)]
    for i, it in enumerate(range(first, first + iterations)):
        for name, tr in pairs if i % 2 else pairs[::-1]:
            times[name].append(tr.run_iteration(it).seconds)
    a, b = statistics.median(times["plain"]), statistics.median(times["rmu"])
    return {
        "plain_iteration_s": a,
        "rmu_iteration_s": b,
        "overhead_pct": 100 * (b / a - 1),
        "samples": times,
    }


def _phase_overhead(r: dict[str, Any], plain_iteration_s: float) -> float:
    """Protection's own time per iteration (the protected update's extra milliseconds over the
    plain update, plus the gradient parity), as a percentage of a plain iteration. Each phase
    is timed with the device synchronized around it, so this is steady where the ABBA medians
    are not: whole 1b iterations on the H200 varied by 10-20 % between neighbours, more than
    protection's share of them."""
    extra_ms = r["rmu_update_ms"] - r["plain_update_ms"] + r["rmu_protect_ms"]
    return 100 * extra_ms / (plain_iteration_s * 1e3)


def _hbm(regions: dict, geometry, staging: int = 0) -> dict[str, Any]:
    """Protection's HBM over the retained state: every device region but the state's, and the
    updater's own staging buffers (`staging` bytes), none lent (`_lent_hbm` corrects it)."""
    retained = sum(regions[k].numel() for k in ("model", "grads"))
    extra = {k: t.numel() for k, t in regions.items() if k not in ("model", "grads") and t.is_cuda}
    if staging:
        extra["staging"] = staging
    return {
        "retained_bytes": retained,
        "protection_bytes": extra,
        "hbm_overhead_pct": 100 * sum(extra.values()) / retained,
    }


def _lent_hbm(r: dict[str, Any], lending: dict[str, Any]) -> None:
    """Protection's HBM with the lent buffers holding activations between updates: what is
    never lent (the staging buffers) plus what the activations left unused of the lent regions
    at their peak. The figure without lending stays as `hbm_reserved_pct`."""
    own = sum(r["protection_bytes"].values()) - lending["lent_peak"]
    r["hbm_reserved_pct"] = r["hbm_overhead_pct"]
    r["hbm_overhead_pct"] = 100 * own / r["retained_bytes"]


def _checkpoints(trainer, root: Path, first: int) -> dict[str, Any]:

    from unbroken.checkpoint import (
        CheckpointStager,
        find_latest_valid,
        load_checkpoint,
        save_checkpoint_async,
    )

    state = trainer.state
    stager = CheckpointStager()
    out: dict[str, Any] = {"bytes": sum(t.numel() * 4 for t in state.persistent().values())}
    t0 = time.perf_counter()
    stager.reserve(state)  # a trainer does this at start-up, off the critical path
    out["reserve_s"] = time.perf_counter() - t0
    pend = save_checkpoint_async(root, state, first, group=None, rank=0, keep=1, stager=stager)
    out["first_save_blocking_s"] = pend.blocking_s
    during = [trainer.run_iteration(first + i).seconds for i in range(2)]
    out["first_save_total_s"] = pend.wait()
    it = first + 2
    expected = state.state_hash()
    pend = save_checkpoint_async(root, state, it, group=None, rank=0, keep=1, stager=stager)
    out["ckpt_save_blocking_s"] = pend.blocking_s
    during += [trainer.run_iteration(it + i).seconds for i in range(3)]
    out["save_total_s"] = pend.wait()
    out["iteration_s_while_saving"] = during
    # The restart path: find (the seal's quick check), load into the live buffers.
    for t in state.persistent().values():
        t.zero_()
    _sync()
    t0 = time.perf_counter()
    info = find_latest_valid(root)
    out["find_s"] = time.perf_counter() - t0
    assert info is not None, "no valid checkpoint after the save"
    t1 = time.perf_counter()
    load_checkpoint(info, state, group=None, stager=stager)
    _sync()
    out["load_s"] = time.perf_counter() - t1
    out["load_gb_per_s"] = out["bytes"] / out["load_s"] / 1e9
    out["round_trip_exact"] = state.state_hash() == expected
    return out


@dataclass(slots=True)
class _Bench:
    """What the phases of one bench run share: the plain trainer and the iteration counter."""

    args: argparse.Namespace
    cfg: Any
    device: Any
    plain: Any
    plain_upd: _TimedUpdater
    built: Any
    init: Any
    result: dict[str, Any]
    first: int = 0
    best: str = ""


def _setup(args: argparse.Namespace) -> _Bench:
    import torch

    # The trainers' settings (unbroken.launch.trainer): deterministic kernels, fixed workspace.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    # Deterministic mode also fills every new allocation with NaN (a debugging aid; ~10 % of
    # the 1b step on an H200). Bit-exactness does not depend on it.
    torch.utils.deterministic.fill_uninitialized_memory = args.fill_uninitialized
    cuda = args.device == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    cfg = _job(args, args.microbatches)
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "torch": torch.__version__,
        "preset": args.preset,
        "tokens_per_iteration": args.tokens * args.microbatches,
        "peak_tflops": args.peak_tflops,
        "l3_recovery_s": None,
        "ckpt_restart_s": None,
        "trials": None,
        "exact": None,
        "fill_uninitialized_memory": args.fill_uninitialized,
    }
    t0 = time.time()
    _say(f"building {args.preset} (plain updater)")
    plain, plain_upd, built, _, _ = _build(cfg, device, protected=False)
    _say(f"built in {time.time() - t0:.1f} s; warm-up")
    init = built.state.params.clone()
    return _Bench(args, cfg, device, plain, plain_upd, built, init, result)


def _modes(args: argparse.Namespace) -> list[str]:
    """The step's modes, in the order timed (compiling cannot be undone in place)."""
    modes = ["eager"]
    if args.compile:
        modes.append("compiled")
    if args.cuda_graphs:
        modes.append("graphs")
    return modes


def _steps(b: _Bench) -> None:
    """The step per attention kernel, eager and (with --compile) compiled; keeps the best."""
    args, plain = b.args, b.plain
    cuda = b.device.type == "cuda"
    kernels = [k for k in args.kernels.split(",") if k] if cuda else ["dense"]
    if cuda:
        b.result["attention"] = _attention_figures(plain, kernels)
        _say(f"attention: {b.result['attention']}")
    steps: dict[str, dict] = {}
    for mode in _modes(args):
        if mode != "eager":
            from unbroken.model import compile_blocks

            compile_blocks(plain.model, cuda_graphs=mode == "graphs")
        for kernel in kernels:
            plain.model.attention_kernel = kernel if kernel != "dense" else "varlen"
            # The same compiled configuration measured 0.57-0.72 s per iteration in different
            # phases of one run (bench/results/gpu-h200.md); warm compiled variants longer.
            warm = 4 if mode != "eager" else 2
            t1 = time.time()
            _time_step(plain, warm, b.first)
            warm_s = time.time() - t1
            res = _time_step(plain, args.iterations, b.first + warm)
            b.first += warm + args.iterations
            name = f"{mode}_{kernel}"
            steps[name] = _step_figures(plain, res, args.peak_tflops) | {"warmup_s": warm_s}
            _say(
                f"step {name}: {steps[name]['iteration_s']:.3f} s/iter, MFU {steps[name]['mfu']:.3f}"
            )
    b.best = min(steps, key=lambda k: steps[k]["iteration_s"])
    best = steps[b.best]
    b.result.update(
        steps=steps,
        step=b.best,
        mfu=best["mfu"],
        mfu_full_causal=best["mfu_full_causal"],
        iteration_s=best["iteration_s"],
        plain_update_ms=1e3 * statistics.median(b.plain_upd.update_s[2:]),
    )
    if b.best.split("_")[0] != _modes(args)[-1]:
        # compile_blocks cannot be undone in place: later figures run as the last mode anyway.
        b.result["note"] = f"later figures ran in mode {_modes(args)[-1]}"
    kernel = b.best.split("_", 1)[1]
    plain.model.attention_kernel = kernel if kernel != "dense" else "varlen"
    _say(f"best step {b.best}; plain update {b.result['plain_update_ms']:.2f} ms")


def _leto_shaped(b: _Bench, rmu) -> None:
    """Protection overhead with micro-batches added until compute >= 100x the plain update."""
    from unbroken.data import PackedStream, Sampler, corpus_for

    args, r = b.args, b.result
    compute_s = r["overhead"]["plain_iteration_s"] - r["plain_update_ms"] / 1e3
    need = 120 * r["plain_update_ms"] / 1e3  # 100x, with a margin for noise
    mbs = max(args.microbatches, int(-(-need // (compute_s / args.microbatches))))
    stream = PackedStream(corpus_for(b.cfg.data), args.tokens, b.cfg.data.seed)
    for tr in (b.plain, rmu):
        tr.source = Sampler(stream, 1, mbs)
    n = max(4, args.iterations // 2)
    leto = _overhead(b.plain, rmu, n, b.first)
    b.first += n
    leto["microbatches"] = mbs
    leto["compute_over_plain_update"] = (
        leto["plain_iteration_s"] * 1e3 - r["plain_update_ms"]
    ) / r["plain_update_ms"]
    r.update(overhead_leto=leto, overhead_pct_leto=leto["overhead_pct"])
    r["overhead_pct_leto_phases"] = _phase_overhead(r, leto["plain_iteration_s"])
    for tr in (b.plain, rmu):
        tr.source = b.built.source


def _protection(b: _Bench) -> None:
    """The resumable updater against the plain one: update times, overheads, HBM, geometries."""
    import torch

    args, r, cuda = b.args, b.result, b.device.type == "cuda"
    _say("building the resumable updater's trainer")
    mode = _modes(args)[-1]  # the plain trainer's blocks are in the last mode timed
    rmu, rmu_upd, _, regions, geometry = _build(
        b.cfg, b.device, protected=True, init_from=b.init, mode=mode, kind=args.rmu_kind
    )
    r["rmu_kind"] = type(rmu_upd.inner).__name__
    rmu.model.attention_kernel = b.plain.model.attention_kernel
    r["geometry"] = dataclasses.asdict(geometry)
    r["protection"] = dataclasses.asdict(b.cfg.protection.resolved(cuda))
    r.update(_hbm(regions, geometry, rmu_upd.inner.staging_bytes))
    _time_step(rmu, 2, 0)
    b.plain_upd.update_s.clear()
    ov = _overhead(b.plain, rmu, args.iterations, b.first)
    b.first += args.iterations
    r["rmu_update_ms"] = 1e3 * statistics.median(rmu_upd.update_s[2:])
    r["rmu_first_update_ms"] = 1e3 * rmu_upd.update_s[0]  # the graph's capture included
    r["rmu_capture_ms"] = 1e3 * getattr(rmu_upd.inner, "capture_s", 0.0)
    r["plain_update_ms"] = 1e3 * statistics.median(b.plain_upd.update_s)
    r["rmu_protect_ms"] = 1e3 * statistics.median(rmu_upd.protect_s[2:])
    r["rmu_vs_plain_update"] = r["rmu_update_ms"] / r["plain_update_ms"]
    r.update(overhead=ov, overhead_pct=ov["overhead_pct"])
    r["overhead_pct_phases"] = _phase_overhead(r, ov["plain_iteration_s"])
    _leto_shaped(b, rmu)
    del rmu, regions
    if cuda:
        torch.cuda.empty_cache()
    if args.rmu_geometries:
        kernel = b.plain.model.attention_kernel
        r["rmu_geometries"] = _geometry_sweep(
            b.cfg, b.device, b.init, args.rmu_geometries, kernel, mode, args.rmu_kind
        )


def _memory_breakdown(device, lending) -> dict[str, int]:
    """Where a trainer's reserved device memory sits after its iterations: torch's counters
    (reserved now and at peak, the peak of allocated bytes, of free bytes inside split
    segments) and, lent, the lending pool's own segments: how many, and their bytes (the
    lent ranges and what the raw allocator took from the driver past them)."""
    import torch

    stats = torch.cuda.memory_stats(device)
    out = {
        "reserved": stats.get("reserved_bytes.all.current", 0),
        "reserved_peak": stats.get("reserved_bytes.all.peak", 0),
        "allocated_peak": stats.get("allocated_bytes.all.peak", 0),
        "inactive_split_peak": stats.get("inactive_split_bytes.all.peak", 0),
    }
    if lending is not None:
        segments = lending.pool.snapshot()
        out["pool_segments"] = len(segments)
        out["pool_reserved"] = sum(seg["total_size"] for seg in segments)
    return out


def _lending(b: _Bench) -> None:
    """The compute phase in the updater's lent buffers (`unbroken.update.lending`), eager blocks
    as jobs run them: how much of the lent regions the activations fill at their peak (which
    sets `hbm_overhead_pct`), the iteration with and without lending, and whether both leave the
    same bits after the same iterations from the same state."""
    import torch

    args, r = b.args, b.result
    n = max(3, args.iterations // 2)
    out: dict[str, Any] = {"iterations": n}
    reference = None
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(b.device)
    out["reserved_before"] = torch.cuda.memory_reserved(b.device)
    for lend in (False, True):
        tr, upd, _, regions, _ = _build(
            b.cfg, b.device, protected=True, init_from=b.init, mode="eager", lend=lend
        )
        tr.model.attention_kernel = b.plain.model.attention_kernel
        res = _time_step(tr, n, b.first)
        name = "lent" if lend else "unlent"
        out[f"iteration_s_{name}"] = statistics.median(x.seconds for x in res[1:])
        out[f"peak_reserved_{name}"] = torch.cuda.max_memory_reserved(b.device)
        out[f"memory_{name}"] = _memory_breakdown(b.device, upd.lending if lend else None)
        model = regions["model"]
        if reference is None:  # in host memory: a device copy would sit in the next peak
            reference = model.cpu()
        else:
            out["bit_exact"] = bool(torch.equal(reference, model.cpu()))
            out.update(dataclasses.asdict(upd.lending.stats()))
            out["phases"] = upd.lending.phases
            upd.lending.retire()  # the regions go with the trainer
        del tr, upd, regions, model
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(b.device)
    b.first += n
    # The bench's regions are caching-allocator blocks, and the pool's segments inside the lent
    # ones count in torch's reserved bytes again: the lent trainer's peak without them.
    out["peak_reserved_lent_net"] = out["peak_reserved_lent"] - out["lent_bytes"]
    r["lending"] = out
    _lent_hbm(r, out)
    _say(
        f"lending: {out['lent_peak'] / 2**20:.0f} of {out['lent_bytes'] / 2**20:.0f} MiB lent "
        f"filled, iteration {out['iteration_s_lent']:.3f} s lent vs "
        f"{out['iteration_s_unlent']:.3f} unlent, bit-exact {out['bit_exact']}; HBM "
        f"+{r['hbm_overhead_pct']:.2f} % (reserved {r['hbm_reserved_pct']:.2f} %)"
    )


_HEADLINE = (
    "mfu",
    "plain_update_ms",
    "rmu_update_ms",
    "overhead_pct",
    "overhead_pct_leto",
    "overhead_pct_phases",
    "overhead_pct_leto_phases",
    "hbm_overhead_pct",
    "ckpt_save_blocking_s",
    "l3_recovery_s",
    "l3_attach_s",
    "l3_first_iteration_s",
    "l3_second_iteration_s",
    "l3_steady_iteration_s",
    "ckpt_restart_s",
    "trials",
    "exact",
)


def run(args: argparse.Namespace) -> int:
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("unbroken bench gpu needs a CUDA device", file=sys.stderr)
        return 2
    t0 = time.time()
    if args.update_only:
        from unbroken.bench.gpu_update import update_phase

        result = update_phase(args, _job(args, args.microbatches), _build, _say)
        result["wall_s"] = time.time() - t0
        print(json.dumps(result, indent=1, default=str))
        return 0
    b = _setup(args)
    _steps(b)
    if args.profile_step and b.device.type == "cuda":
        from unbroken.bench.gpu_profile import profile_step

        b.result["step_profile"] = profile_step(b.plain, 2, b.first, args.profile_step)
        b.first += 2
        _say(f"step profile: {b.result['step_profile']}")
    if not args.no_rmu:
        _protection(b)
        if b.device.type == "cuda":
            _lending(b)
    result = b.result
    if not args.no_ckpt:
        root = Path(args.ckpt_dir or tempfile.mkdtemp(prefix="unbroken-ckpt-"))
        _say(f"checkpoints under {root}")
        result["ckpt"] = _checkpoints(b.plain, root, b.first)
        result["ckpt_save_blocking_s"] = result["ckpt"]["ckpt_save_blocking_s"]
    del b  # the jobs below need the device memory of this process's trainer
    if args.jobs:
        torch.cuda.empty_cache()
        jobs_out = Path(args.jobs_out or tempfile.mkdtemp(prefix="unbroken-jobs-"))
        result["jobs"] = _jobs(args, jobs_out)
        for name, key in (("L3", "l3_recovery_s"), ("ckpt_restart", "ckpt_restart_s")):
            if name in result["jobs"]:
                result[key] = result["jobs"][name]["recovery_s"]
        for key in ("attach_s", "first_iteration_s", "second_iteration_s", "steady_iteration_s"):
            result[f"l3_{key}"] = result["jobs"].get("L3", {}).get(key)
    if args.kill_trials:
        result["kills"] = _kills(args)
        result["trials"], result["exact"] = result["kills"]["trials"], result["kills"]["exact"]
    result["wall_s"] = time.time() - t0
    if args.json:
        print(json.dumps(result, indent=1, default=str))
    else:
        for k in _HEADLINE:
            print(f"{k:24s} {result.get(k)}")
    return 0
