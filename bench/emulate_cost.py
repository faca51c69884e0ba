"""What computing as a TP group costs a TP-1 stage (`unbroken.engine.emulate`): the whole model
as one stage, one micro-batch's forward and backward, with `emulate=1` (the reference model's
arithmetic: one GEMM per linear) and `emulate=2` (each TP-2 position's GEMMs on its shard, the
row-parallel shards copied contiguous, the group's sums done locally), alternated in one
process.

    PYTHONPATH=src python bench/emulate_cost.py [--preset tiny] [--tokens 256] [--repeats 20]
    PYTHONPATH=src python bench/emulate_cost.py --device cuda --preset 1b --tokens 4096

Prints the median seconds of each and the ratio emulate-2 / plain. On CUDA the step runs under
bf16 autocast over fp32 parameters, as the trainer runs it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from unbroken.config import ModelConfig
from unbroken.engine import MicroBatchInputs, StageModel, TPGroup
from unbroken.model import resolve_args


def _step(stage, inputs, layers, device) -> float:
    stage.zero_grad(set_to_none=False)
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        loss = stage(layers, None, inputs)
    loss.backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="tiny")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    device = torch.device(args.device)
    margs = resolve_args(ModelConfig(preset=args.preset))
    layers = (0, margs.n_layers)
    stages = {e: StageModel(margs, [layers], TPGroup(), device=device, emulate=e) for e in (1, 2)}
    gen = torch.Generator(device="cpu").manual_seed(0)
    with torch.no_grad():
        for p1, p2 in zip(stages[1].parameters(), stages[2].parameters(), strict=True):
            p1.copy_(torch.randn(p1.shape, generator=gen) * 0.02)
            p2.copy_(p1)
    t = args.tokens
    tokens = torch.randint(0, margs.vocab_size, (t + 1,), generator=gen).to(device)
    mask = torch.ones(t, t, dtype=torch.bool, device=device).tril()
    inputs = MicroBatchInputs(tokens[:t], tokens[1:], torch.arange(t, device=device), mask)
    times: dict[int, list[float]] = {1: [], 2: []}
    for i in range(args.repeats + 2):
        for e, stage in stages.items():
            s = _step(stage, inputs, layers, device)
            if i >= 2:  # warm-up: allocator, kernels
                times[e].append(s)
    med = {e: statistics.median(v) for e, v in times.items()}
    params = sum(x.numel() for x in stages[1].parameters())
    print(
        f"{args.preset} ({params:,} parameters), {t} tokens, {device.type}: "
        f"plain {med[1] * 1e3:.2f} ms, as TP 2 {med[2] * 1e3:.2f} ms, "
        f"ratio {med[2] / med[1]:.3f} (median of {args.repeats})"
    )


if __name__ == "__main__":
    main()
