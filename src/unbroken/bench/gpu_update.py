"""`unbroken bench gpu --update-only`: the update phase alone, in a minute instead of the full
bench's several — the plain update and resumable updater variants on the same state and the
same (random, seeded) gradients, with no training step.

Each variant starts from the same initial state, runs `--iterations` updates and must end
with the plain updater's state hash and parity that re-encodes to itself (`exact`); its
update time is the median of the updates after the first two (the first captures the graph),
device synchronized around each, as the full bench times `rmu_update_ms`. Variants
(`--update-variants`): a factory kind (`auto`, `unfused`, `stream`) or
``fused:PLANES:BLOCK:WARPS``, the graph updater with that `FusedTransaction` tuning. With
`--profile-update FILE`, one update of each variant runs under `torch.profiler` and the
device time per kernel name goes to FILE and into the result (`kernels_ms`).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

__all__ = ["update_phase"]

_LR = 3e-4


def _noop(*args: Any) -> None:
    return None


def _grads(state, iteration: int) -> None:
    import torch

    gen = torch.Generator(device=state.grads.device).manual_seed(1000 + iteration)
    state.grads.normal_(0.0, 1e-3, generator=gen)


def _updater(variant: str, built, regions, prot):
    from unbroken.update.factory import resumable_updater
    from unbroken.update.graph import GraphUpdater

    if variant.startswith("fused:"):
        planes, block, warps = (int(x) for x in variant.split(":")[1:])
        tuning = {"planes": planes, "block": block, "warps": warps}
        return GraphUpdater(
            built.state, built.geometry, built.step, regions, prot, fused_tuning=tuning
        )
    return resumable_updater(built.state, built.geometry, built.step, regions, prot, kind=variant)


def _kernel_times(prof, iterations: int = 1) -> dict[str, float]:
    """Device ms per kernel name over the profiled region (largest first)."""
    out: dict[str, float] = {}
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None)
        if us is None:
            us = getattr(e, "self_cuda_time_total", 0.0)
        if us > 0:
            out[e.key[:90]] = round(us / 1e3 / iterations, 4)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def _timed_updates(upd, state, iterations: int, sync) -> tuple[list[float], list[float]]:
    """Seconds of each update and of each gradients' protection before it, device
    synchronized around each."""
    times, protect = [], []
    for it in range(iterations):
        _grads(state, it)
        sync()
        t0 = time.perf_counter()
        upd.protect(it)
        sync()
        protect.append(time.perf_counter() - t0)
        upd.record_sync(it, loss=0.0, grad_norm=1.0, grad_scale=1.0, lr=_LR)
        sync()
        t0 = time.perf_counter()
        upd.update(it, lr=_LR, grad_scale=1.0, hook=_noop)
        sync()
        times.append(time.perf_counter() - t0)
    return times, protect


def _run_variant(variant, built, regions, prot, init, args, say) -> dict[str, Any]:
    import torch

    def _sync() -> None:
        torch.cuda.synchronize()

    s = built.state
    s.params.copy_(init)
    s.exp_avg.zero_()
    s.exp_avg_sq.zero_()
    t0 = time.perf_counter()
    upd = _updater(variant, built, regions, prot)
    build_ms = 1e3 * (time.perf_counter() - t0)
    upd.initialize(-1)
    times, protect = _timed_updates(upd, s, args.iterations, _sync)
    row: dict[str, Any] = {
        "kind": type(upd).__name__,
        "fused": getattr(upd, "fused", None) is not None,
        "update_ms": 1e3 * statistics.median(times[2:]),
        "first_update_ms": 1e3 * times[0],
        "protect_ms": 1e3 * statistics.median(protect[2:]),
        "build_ms": build_ms,
        "parity_register_ms": 1e3 * upd.parity_register_s,
        "parity_memory": "device" if upd.model_parity.is_cuda else "host",
        "state_hash": s.state_hash(),
    }
    before = upd.model_parity.clone()
    for group in upd.groups:
        group.encode()
    row["parity_exact"] = bool(torch.equal(before, upd.model_parity))
    row.update(_table_encode(upd, regions["grad_parity"], _sync))
    if args.profile_update:
        it = args.iterations
        _grads(s, it)
        upd.protect(it)
        upd.record_sync(it, loss=0.0, grad_norm=1.0, grad_scale=1.0, lr=_LR)
        _sync()
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as prof:
            upd.update(it, lr=_LR, grad_scale=1.0, hook=_noop)
            _sync()
        row["kernels_ms"] = _kernel_times(prof)
        with open(args.profile_update, "a") as f:
            f.write(f"== {variant}\n")
            for name, ms in row["kernels_ms"].items():
                f.write(f"{ms:10.4f} ms  {name}\n")
    say(f"variant {variant}: {row['update_ms']:.2f} ms, parity exact {row['parity_exact']}")
    del upd
    return row


def _table_encode(upd, grad_parity, sync) -> dict[str, Any]:
    """The gradients' encode by the word-table kernel instead of Horner's rule, where the
    codec takes Horner's (the GPU's Vandermonde tier): its time, and whether its parity equals
    the Horner encode's byte for byte."""
    import torch

    codecs = [c for g in upd.grad_groups for c in (g.first_tier_codec, g.second_tier_codec)]
    codecs = [c for c in codecs if c is not None and c.tuning.get("horner")]
    if not codecs:
        return {}
    out: dict[str, Any] = {}
    for name, flag in (("horner", 1), ("table", 0)):
        for c in codecs:
            c.tuning["horner"] = flag
        secs = []
        for _ in range(5):
            sync()
            t0 = time.perf_counter()
            for group in upd.grad_groups:
                group.encode()
            sync()
            secs.append(time.perf_counter() - t0)
        out[f"grad_encode_{name}_ms"] = 1e3 * statistics.median(secs[1:])
        out[f"grad_parity_{name}"] = grad_parity.clone()
    horner, table = out.pop("grad_parity_horner"), out.pop("grad_parity_table")
    out["grad_encode_exact"] = bool(torch.equal(horner, table))
    for c in codecs:
        c.tuning["horner"] = 1
    return out


def _protected(cfg, device, prot):
    """The protected state on local device regions, no updater yet (each variant builds its
    own). The marker region is pinned host memory: no variant's marker registers it, so none
    unregisters it under the next one."""
    import torch

    from unbroken.engine.replica import build_training
    from unbroken.update.rmu import local_allocator

    regions: dict[str, torch.Tensor] = {}
    allocate = local_allocator(prot, regions, pin_marker=True)
    return build_training(cfg, n_shards=1, device=device, allocate=allocate), regions


def update_phase(args: argparse.Namespace, cfg, build_plain, say) -> dict[str, Any]:
    """The `--update-only` figures (see the module docstring).

    Args:
        args: the bench's arguments.
        cfg: the bench's job config.
        build_plain: `unbroken.bench.gpu._build` (passed in: this module must not import the
            bench that imports it).
        say: the bench's progress printer.
    """
    import torch

    torch.use_deterministic_algorithms(True)  # the trainers' setting, as in the full bench
    torch.utils.deterministic.fill_uninitialized_memory = args.fill_uninitialized
    device = torch.device("cuda", torch.cuda.current_device())
    prot = cfg.protection.resolved(True)
    say(f"building {args.preset}: plain and protected state")
    plain, plain_upd, pbuilt, _, _ = build_plain(cfg, device, protected=False)
    init = pbuilt.state.params.clone()
    for it in range(args.iterations):
        _grads(pbuilt.state, it)
        plain_upd.update(it, lr=_LR, grad_scale=1.0, hook=_noop)
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "preset": args.preset,
        "iterations": args.iterations,
        "plain_update_ms": 1e3 * statistics.median(plain_upd.update_s[2:]),
        "plain_state_hash": pbuilt.state.state_hash(),
    }
    del plain, plain_upd, pbuilt
    built, regions = _protected(cfg, device, prot)
    geometry = built.geometry
    result["geometry"] = {"chunks": len(geometry.chunks()), "stripe": geometry.stripe_pages}
    variants: dict[str, Any] = {}
    for variant in [v for v in args.update_variants.split(",") if v]:
        try:
            row = _run_variant(variant, built, regions, prot, init, args, say)
        except Exception as e:  # a variant that fails is reported; the others still run
            say(f"variant {variant} failed: {e!r}")
            variants[variant] = {"error": repr(e)[:2000]}
            continue
        row["exact"] = row["state_hash"] == result["plain_state_hash"] and row["parity_exact"]
        row["vs_plain"] = row["update_ms"] / result["plain_update_ms"]
        variants[variant] = row
    result["variants"] = variants
    return result
