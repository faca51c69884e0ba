"""Reed–Solomon codec throughput (encode, fused update, reconstruct) vs ISA-L and zfec.

For each configuration (data pages D, parity pages H, block = bytes per page) it measures, on one
set of buffers and interleaved with the baselines in the same run: encode GB/s, fused update
(``parity ^= Encode(old ^ new)``) GB/s, and the time to rebuild H lost data pages. GB/s counts
data bytes (D × block) per second. Each figure is the best of ``--repeat`` runs, which filters
out the noise of a shared machine; baselines get the same treatment. ISA-L gets its best: its
slice size is calibrated in the same run separately for encode and for the update, and the update
also picks the faster of ISA-L's two ways to apply it (``isal_update_method``; see isal_backend).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable

import numpy as np

from unbroken.bench.erasure_report import command_line, machine_name, print_row
from unbroken.errors import UserError

__all__ = ["add_arguments", "run"]

_KIB = 1 << 10


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add this benchmark's flags to its subparser."""
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where pages live")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--backend", default="auto", help="codec backend (default: the fastest)")
    parser.add_argument("--data-pages", default="32,240", help="comma-separated D values")
    parser.add_argument("--parity-pages", default="4,16", help="comma-separated H values")
    parser.add_argument(
        "--block-kib",
        default=None,
        help="comma-separated page sizes in KiB (default 64,1024; on cuda also 2048)",
    )
    parser.add_argument("--repeat", type=int, default=None, help="runs per figure (best kept)")
    parser.add_argument("--no-baselines", action="store_true", help="skip the baselines")
    parser.add_argument(
        "--cuda-kernel",
        choices=("auto", "xor", "tc"),
        default="auto",
        help="GPU kernel: CUDA-core XOR, tensor-core, or auto",
    )


def _ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UserError(f"{flag} takes comma-separated integers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise UserError(f"{flag} takes positive integers, got {text!r}")
    return values


class _Clock:
    """Best-of-N wall time of a callable; synchronises CUDA around it when needed."""

    def __init__(self, sync: Callable[[], None] | None) -> None:
        self.sync = sync or (lambda: None)

    def once(self, fn: Callable[[], None]) -> float:
        self.sync()
        start = time.perf_counter()
        fn()
        self.sync()
        return time.perf_counter() - start


def _alloc(device: str, shape: tuple[int, int], rng: np.random.Generator):
    host = rng.integers(0, 256, shape, dtype=np.uint8)
    if device == "cpu":
        return host
    import torch

    return torch.from_numpy(host).to("cuda")


def _zeros(device: str, shape: tuple[int, int]):
    if device == "cpu":
        return np.zeros(shape, dtype=np.uint8)
    import torch

    return torch.zeros(shape, dtype=torch.uint8, device="cuda")


def _measure(args, device: str, d: int, h: int, block: int, baselines: dict) -> dict:
    """All figures of one (D, H, block) configuration, ours and the baselines'."""
    from unbroken.erasure import PageTable, get_codec

    rng = np.random.default_rng(d * 1000 + h)
    if device == "cpu" or args.cuda_kernel == "auto":
        codec = get_codec(d, h, device=device, backend=args.backend)
    else:
        from unbroken.erasure.cuda_backend import TritonCodec

        codec = TritonCodec(d, h, kernel=args.cuda_kernel)
    old = _alloc(device, (d, block), rng)
    new = _alloc(device, (d, block), rng)
    parity = _zeros(device, (h, block))
    old_t, new_t, par_t = (PageTable.from_rows(x) for x in (old, new, parity))
    everything = PageTable.concat([old_t, par_t])
    lost = list(range(h))  # the worst case: H data pages, decoded from all parity pages

    sync = None
    if device != "cpu":
        import torch

        sync = torch.cuda.synchronize
    clock = _Clock(sync)
    repeat = args.repeat or (3 if device == "cpu" else 20)
    isal = baselines.get("isal")
    isal_codecs = _calibrated_isal(isal, d, h, block, old_t, new_t, clock) if isal else (None, None)
    isal_parity = np.zeros((h, block), dtype=np.uint8) if isal_codecs[0] else None
    tables = (old_t, new_t, par_t, everything)
    best = _best_times(codec, isal_codecs, isal_parity, tables, lost, clock, repeat)
    cold, fresh, verified = _rebuild_checks(codec, device, old, tables, d, lost, clock)
    data_bytes = d * block
    result = {
        "device": device,
        "backend": codec.backend,
        "data_pages": d,
        "parity_pages": h,
        "block_bytes": block,
        "encode_gbps": data_bytes / best["encode"] / 1e9,
        "update_gbps": data_bytes / best["update"] / 1e9,
        "reconstruct_ms": best["reconstruct"] * 1e3,
        "reconstruct_cold_ms": cold * 1e3,
        "reconstruct_cold_lost": len(fresh),
        "isal_encode_gbps": None,
        "isal_update_gbps": None,
        "zfec_encode_gbps": None,
        "reconstruct_verified": verified,
    }
    result |= _baseline_figures(args, device, old, d, h, baselines, isal_codecs, best, clock)
    return result


def _baseline_figures(
    args, device: str, old, d: int, h: int, baselines: dict, isal_codecs, best: dict, clock: _Clock
) -> dict:
    """The baselines' figures for one configuration: ISA-L's (from `best`, with the slice sizes
    and update method it was calibrated to), the plain-torch GPU encoder's, zfec's."""
    data_bytes = d * old.shape[1]
    extra: dict = {}
    isal_enc, isal_upd = isal_codecs
    if isal_enc is not None:
        extra["isal_encode_slice_bytes"] = isal_enc.slice_bytes
        extra["isal_update_slice_bytes"] = isal_upd.slice_bytes
        extra["isal_update_method"] = isal_upd.update_method
        extra["isal_encode_gbps"] = data_bytes / best["isal_encode"] / 1e9
        extra["isal_update_gbps"] = data_bytes / best["isal_update"] / 1e9
    if device != "cpu" and not args.no_baselines:
        seconds = min(clock.once(_torch_gather_encoder(old, d, h)) for _ in range(2))
        extra["torch_gather_encode_gbps"] = data_bytes / seconds / 1e9
    zfec = baselines.get("zfec")
    if zfec is not None and d + h <= 256:
        blocks = [bytes(row) for row in (old if device == "cpu" else old.cpu().numpy())]
        encoder = zfec.Encoder(d, d + h)
        seconds = min(clock.once(lambda: encoder.encode(blocks)) for _ in range(1))
        extra["zfec_encode_gbps"] = data_bytes / seconds / 1e9
    return extra


def _best_times(
    codec, isal_codecs, isal_parity, tables, lost: list[int], clock: _Clock, repeat: int
) -> dict[str, float]:
    """Best of `repeat` seconds of our encode, fused update and rebuild of `lost`, and of ISA-L's
    encode and update (`isal_codecs`: (encoder, updater), or Nones; its parity goes to
    `isal_parity`), measured in turns. `tables`: old, new, parity and old + parity pages."""
    from unbroken.erasure import PageTable

    old_t, new_t, par_t, everything = tables
    best = {
        "encode": float("inf"),
        "update": float("inf"),
        "reconstruct": float("inf"),
        "isal_encode": float("inf"),
        "isal_update": float("inf"),
    }
    isal_enc, isal_upd = isal_codecs
    codec.encode(old_t, par_t)  # warm-up (compiles GPU kernels, builds cached operands)
    codec.update_from_old_new(par_t, old_t, new_t)
    codec.reconstruct(everything, lost)
    for _ in range(repeat):
        best["encode"] = min(best["encode"], clock.once(lambda: codec.encode(old_t, par_t)))
        best["update"] = min(
            best["update"], clock.once(lambda: codec.update_from_old_new(par_t, old_t, new_t))
        )
        best["reconstruct"] = min(
            best["reconstruct"], clock.once(lambda: codec.reconstruct(everything, lost))
        )
        if isal_enc is not None:
            ip = PageTable.from_rows(isal_parity)
            best["isal_encode"] = min(
                best["isal_encode"], clock.once(lambda ip=ip: isal_enc.encode(old_t, ip))
            )
            best["isal_update"] = min(
                best["isal_update"],
                clock.once(lambda ip=ip: isal_upd.update_from_old_new(ip, old_t, new_t)),
            )
    return best


def _rebuild_checks(codec, device: str, old, tables, d: int, lost: list[int], clock: _Clock):
    """(seconds of a first rebuild of a new loss pattern, that pattern, whether a rebuild
    restores the lost bytes exactly). `old`: the data pages, whose first H are overwritten."""
    old_t, _, par_t, everything = tables
    h = len(lost)
    # A first rebuild of a new loss pattern also plans it (solves for the decoding matrix) and
    # uploads its operands: what a real failure pays.
    fresh = [(h + i * 7) % d if i % 2 else d + (i % h) for i in range(h)]
    fresh = sorted(set(fresh))
    cold = clock.once(lambda: codec.reconstruct(everything, fresh))
    # Check the rebuilt bytes once (the timed runs above rebuild from parity of other data).
    codec.encode(old_t, par_t)
    truth = _host(old[:h], device)
    old[:h] = 0
    codec.reconstruct(everything, lost)
    verified = bool((_host(old[:h], device) == truth).all())
    return cold, fresh, verified


ISAL_SLICE_CANDIDATES = (4 * _KIB, 16 * _KIB, 64 * _KIB)
"""Slice sizes tried for ISA-L (plus the whole block), separately for encode and update."""


def _calibrated_isal(isal, d: int, h: int, block: int, old, new, clock: _Clock):
    """ISA-L at its best for this shape, measured now: ``(encode_codec, update_codec)``.

    Encode keeps the fastest slice size; the fused update keeps the fastest (update method,
    slice size) pair on its own, since its working set (delta, scratch, parity) differs.
    """
    from unbroken.erasure import PageTable
    from unbroken.erasure.isal_backend import UPDATE_METHODS, IsalUnavailableError

    parity = PageTable.from_rows(np.zeros((h, block), dtype=np.uint8))
    slices = sorted({s for s in ISAL_SLICE_CANDIDATES if s <= block} | {block})

    def fastest(candidates, op):
        # Candidates take turns, best of 3 each, so a burst of load on a shared machine does
        # not condemn whichever candidate it happened to hit.
        candidates = list(candidates)
        seconds = [float("inf")] * len(candidates)
        for codec in candidates:
            op(codec)  # warm-up (tables, scratch)
        for _ in range(3):
            for i, codec in enumerate(candidates):
                seconds[i] = min(seconds[i], clock.once(lambda c=codec: op(c)))
        return candidates[seconds.index(min(seconds))]

    def update_codecs():
        for method in UPDATE_METHODS:
            for s in slices:
                try:
                    yield isal(d, h, slice_bytes=s, update_method=method)
                except IsalUnavailableError:
                    break

    encoder = fastest((isal(d, h, slice_bytes=s) for s in slices), lambda c: c.encode(old, parity))
    updater = fastest(update_codecs(), lambda c: c.update_from_old_new(parity, old, new))
    return encoder, updater


def _torch_gather_encoder(data, d: int, h: int) -> Callable[[], None]:
    """The naive GPU baseline: product-table gathers and an XOR tree, in plain torch."""
    import torch

    from unbroken.erasure import gf256

    table = torch.from_numpy(np.array(gf256.mul_table())).to(data.device).reshape(-1)
    coef = torch.from_numpy(np.array(gf256.cauchy_matrix(d, h))).to(data.device).long()

    def encode() -> None:
        wide = data.long()
        for r in range(h):
            terms = table[coef[r][:, None] * 256 + wide]
            while terms.shape[0] > 1:
                half = terms.shape[0] // 2
                head = terms[:half] ^ terms[half : 2 * half]
                terms = torch.cat([head, terms[2 * half :]]) if terms.shape[0] % 2 else head

    return encode


def _host(x, device: str) -> np.ndarray:
    return np.array(x, copy=True) if device == "cpu" else x.cpu().numpy()


def _baselines(device: str, disabled: bool) -> tuple[dict, list[str]]:
    notes = []
    found: dict = {}
    if disabled or device != "cpu":
        return found, notes
    try:
        from unbroken.erasure.isal_backend import IsalCodec, load_isal

        load_isal()
        found["isal"] = IsalCodec
    except (ImportError, OSError, RuntimeError) as exc:
        notes.append(f"ISA-L not measured: {exc}")
    try:
        import zfec

        found["zfec"] = zfec
    except ImportError:
        notes.append("zfec not measured: `pip install zfec`")
    return found, notes


def run(args: argparse.Namespace) -> int:
    """Run the benchmark and print a table (or one JSON object with ``--json``)."""
    device = args.device
    if device == "cuda":
        try:
            import torch
        except ImportError:
            raise UserError("--device cuda needs torch with CUDA") from None
        if not torch.cuda.is_available():
            raise UserError("--device cuda: no CUDA device is visible")
    data_pages = _ints(args.data_pages, "--data-pages")
    parity_pages = _ints(args.parity_pages, "--parity-pages")
    default_blocks = "64,1024" if device == "cpu" else "64,1024,2048"
    blocks = [b * _KIB for b in _ints(args.block_kib or default_blocks, "--block-kib")]
    for d in data_pages:
        for h in parity_pages:
            if d + h > 256:
                raise UserError(f"D + H must be ≤ 256 for GF(2^8), got D={d}, H={h}")
    baselines, notes = _baselines(device, args.no_baselines)
    results = []
    for d in data_pages:
        for h in parity_pages:
            for block in blocks:
                results.append(_measure(args, device, d, h, block, baselines))
                if not args.json:
                    print_row(results[-1], header=len(results) == 1)
    if args.json:
        summary = {
            "benchmark": "erasure",
            "command": command_line(args),
            "host": platform.node(),
            "machine": machine_name(device),
            "notes": notes,
            "results": results,
        }
        print(json.dumps(summary, indent=2))
    else:
        for note in notes:
            print(note)
    return 0


if __name__ == "__main__":  # `python -m unbroken.bench.erasure`, same flags
    _parser = argparse.ArgumentParser(prog="unbroken bench erasure", description=__doc__)
    add_arguments(_parser)
    raise SystemExit(run(_parser.parse_args()))
