"""Sweep the GPU kernels' launch parameters on the machine at hand (``python -m
unbroken.bench.erasure_tuning [--horner] [D:BYTES ...]``); prints one JSON line per variant. How
`DEFAULT_TUNING` in `cuda_backend` was chosen. Every variant's parity is checked against the CPU
backend first. Without ``--horner``: the Cauchy code of 16 parity pages (the table kernels);
with it: the Vandermonde code of 3 (the GPU's first tier), Horner's rule at several word
blocks and warps against the word-table kernel, on the gradients' (64) and the model's (192)
group widths of 2 MiB pages by default."""

from __future__ import annotations

import itertools
import json
import sys

import numpy as np

__all__ = ["main"]


def _time_ms(torch, fn, repeat: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return float(np.median(times))


def main(argv: list[str] | None = None) -> int:
    """Run the sweep; returns a process exit status."""
    import torch

    args = list(argv if argv is not None else sys.argv[1:])
    rng = np.random.default_rng(0)
    if args[:1] == ["--horner"]:
        shapes = [_shape(a) for a in args[1:]] or [(64, 2 << 20), (192, 2 << 20)]
        variants = [("auto", {"horner": 0})] + [
            ("auto", {"horner_block": b, "horner_warps": w})
            for b, w in itertools.product((256, 512, 1024, 2048), (2, 4, 8))
        ]
        for d, block in shapes:
            _sweep(torch, d, 3, block, variants, rng, generator="vandermonde")
        return 0
    h = 16
    shapes = [(240, int(a)) for a in args] or [(240, 1 << 16), (240, 1 << 20), (32, 1 << 16)]
    variants = [
        ("xor", {"xor_fill": f, "xor_min_cols": c, "xor_min_block": mb})
        for f, c, mb in itertools.product((512, 1024), (8, 16), (128, 512))
    ]
    variants += [("xor", {"xor_block": 1024}), ("tc", {"tc_block": 128, "tc_kj": 16})]
    for d, block in shapes:
        _sweep(torch, d, h, block, variants, rng)
    return 0


def _shape(arg: str) -> tuple[int, int]:
    d, block = arg.split(":")
    return int(d), int(block)


def _sweep(torch, d: int, h: int, block: int, variants, rng, generator: str = "cauchy") -> None:
    from unbroken.erasure import PageTable, get_codec
    from unbroken.erasure.cuda_backend import TritonCodec

    host = rng.integers(0, 256, (d, block), dtype=np.uint8)
    host_new = rng.integers(0, 256, (d, block), dtype=np.uint8)
    ref = np.zeros((h, block), np.uint8)
    get_codec(d, h, generator=generator).encode(PageTable.from_rows(host), PageTable.from_rows(ref))
    old = torch.from_numpy(host).cuda()
    new = torch.from_numpy(host_new).cuda()
    parity = torch.zeros((h, block), dtype=torch.uint8, device="cuda")
    old_t, new_t, par_t = (PageTable.from_rows(x) for x in (old, new, parity))
    pages = PageTable.concat([old_t, par_t])
    for kernel, tuning in variants:
        row = {"kernel": kernel, **tuning, "data_pages": d, "block_bytes": block}
        try:
            codec = TritonCodec(d, h, kernel=kernel, tuning=tuning, generator=generator)
            old.copy_(torch.from_numpy(host))
            codec.encode(old_t, par_t)
            row["exact"] = bool((parity.cpu().numpy() == ref).all())
            enc = _time_ms(torch, lambda c=codec: c.encode(old_t, par_t))
            upd = _time_ms(torch, lambda c=codec: c.update_from_old_new(par_t, old_t, new_t))
            rec = _time_ms(torch, lambda c=codec: c.reconstruct(pages, list(range(h))))
            row |= {
                "encode_gbps": d * block / enc / 1e6,
                "update_gbps": d * block / upd / 1e6,
                "reconstruct_ms": rec,
            }
        except Exception as exc:  # a variant that fails to compile is reported, not fatal
            row["error"] = f"{type(exc).__name__}: {str(exc)[-300:]}"
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
