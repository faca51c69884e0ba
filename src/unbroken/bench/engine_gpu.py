"""`unbroken bench engine --device cuda`: the engine at TP = PP = DP = 1 vs a plain training loop.

One process, one GPU. Both train the same reference model (same initial values, same packed
micro-batches, loss / micro-batches, gradient clipping at 1.0, AdamW with decay on matrices only,
bf16 autocast) for the same iterations, alternating in blocks:

- ours: `build_worker` with a one-rank NCCL world and the plan ``make_plan(1, 1, 1, L, M)`` —
  the `PlanWorker` path with flat storage and the chunked AdamW of the resumable updater's
  geometry (2 MiB pages and chunks, the GPU page size of ARCHITECTURE.md);
- plain: the reference `Transformer` as an ordinary module, `loss.backward()` per micro-batch,
  `clip_grad_norm_`, `torch.optim.AdamW` (foreach), `zero_grad(set_to_none=True)`.

Prints tokens/s of both and the ratio (target >= 0.90, issue #5).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from unbroken.config import DataConfig, JobConfig, ModelConfig, ProtectionConfig, TrainConfig
from unbroken.engine.build import build_worker, full_initial_params, make_source
from unbroken.model import build_model, resolve_args
from unbroken.parallel import make_plan
from unbroken.train import lr_at

__all__ = ["run_gpu"]

_MIB2 = 2 << 20


def _job(preset: str, tokens: int, microbatches: int) -> JobConfig:
    return JobConfig(
        model=ModelConfig(preset=preset),
        data=DataConfig(tokens_per_microbatch=tokens, microbatches=microbatches),
        train=TrainConfig(iterations=1000, lr=3e-4),
        protection=ProtectionConfig(page_bytes=_MIB2, stripe_pages=8, chunk_bytes=_MIB2),
    )


class _PlainLoop:
    def __init__(self, cfg: JobConfig, source, device: torch.device, autocast) -> None:
        self.autocast = autocast
        self.model = build_model(resolve_args(cfg.model), device=device)
        full = full_initial_params(cfg)
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                p.copy_(full[name])
        t = cfg.train
        decay = [p for p in self.model.parameters() if p.ndim >= 2]
        rest = [p for p in self.model.parameters() if p.ndim < 2]
        self.opt = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": t.weight_decay},
                {"params": rest, "weight_decay": 0},
            ],
            lr=t.lr,
            betas=(t.beta1, t.beta2),
            eps=t.eps,
        )
        self.cfg, self.source, self.device = cfg, source, device

    def run_iteration(self, iteration: int) -> None:
        for group in self.opt.param_groups:
            group["lr"] = lr_at(self.cfg.train, iteration)
        mbs = self.source.iteration(iteration, 0)
        for mb in mbs:
            args = [
                x.to(self.device, non_blocking=True)
                for x in (mb.tokens, mb.targets, mb.segment_ids, mb.positions)
            ]
            if self.autocast is None:
                loss = self.model(*args) / len(mbs)
            else:
                with torch.autocast(self.device.type, dtype=self.autocast):
                    loss = self.model(*args) / len(mbs)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.train.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(step, first: int, n: int, device: torch.device) -> list[float]:
    out = []
    for i in range(first, first + n):
        _sync(device)
        t0 = time.perf_counter()
        step(i)
        _sync(device)
        out.append(time.perf_counter() - t0)
    return out


def _alternate(ours, plain, warmup: int, block: int, rounds: int, device) -> dict[str, list]:
    """`warmup` untimed iterations of both, then `rounds` blocks of `block` timed iterations
    each, alternating which goes first; seconds per iteration by engine."""
    for i in range(warmup):
        ours.run_iteration(i)
        plain.run_iteration(i)
    times: dict[str, list[float]] = {"ours": [], "plain": []}
    engines = [("ours", ours.run_iteration), ("plain", plain.run_iteration)]
    it = warmup
    for r in range(rounds):
        for name, step in engines if r % 2 == 0 else engines[::-1]:
            times[name] += _timed(step, it, block, device)
        it += block
    return times


def run_gpu(
    preset: str,
    tokens: int,
    microbatches: int,
    warmup: int,
    block: int,
    rounds: int,
    device: torch.device | None = None,
):
    """Measure both on `device` (default cuda:0; the CPU with gloo and fp32 for a smoke test);
    returns a dict of figures."""
    device = device or torch.device("cuda", 0)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
    cfg = _job(preset, tokens, microbatches)
    autocast = torch.bfloat16 if cuda else None
    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(str(Path(tmp) / "store"), 1)
        dist.init_process_group(
            "nccl" if cuda else "gloo",
            store=store,
            rank=0,
            world_size=1,
            timeout=timedelta(minutes=5),
            device_id=device if cuda else None,
        )
        try:
            plan = make_plan(1, 1, 1, resolve_args(cfg.model).n_layers, microbatches, "1f1b")
            source = make_source(cfg, 1)
            ours = build_worker(
                cfg,
                plan,
                dist.group.WORLD,
                device=device,
                source=source,
                autocast_dtype=autocast,
            ).worker
            plain = _PlainLoop(cfg, source, device, autocast)
            times = _alternate(ours, plain, warmup, block, rounds, device)
        finally:
            dist.destroy_process_group()
    per_iter = tokens * microbatches
    ours_s, plain_s = statistics.median(times["ours"]), statistics.median(times["plain"])
    return {
        "plan": f"tp=1 pp=1 dp=1 ({device.type})",
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "tokens_per_s": per_iter / ours_s,
        "baseline_tokens_per_s": per_iter / plain_s,
        "ratio": plain_s / ours_s,
        "measured_iter_s": ours_s,
        "baseline_iter_s": plain_s,
        "baseline": "plain PyTorch loop (module, backward, clip, torch.optim.AdamW)",
    }
