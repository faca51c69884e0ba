"""How `unbroken bench erasure` reports: the table row of one configuration, the command line
and machine name recorded with `--json`."""

from __future__ import annotations

import argparse
import platform

__all__ = ["command_line", "machine_name", "print_row"]

_KIB = 1 << 10


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:5.2f}x" if a and b else "   - "


def command_line(args: argparse.Namespace) -> str:
    """The `unbroken bench erasure ... --json` command that reproduces this run."""
    parts = ["unbroken", "bench", "erasure", "--device", args.device]
    for flag, value in (
        ("--backend", args.backend),
        ("--data-pages", args.data_pages),
        ("--parity-pages", args.parity_pages),
        ("--block-kib", args.block_kib),
        ("--repeat", args.repeat),
    ):
        if value is not None:
            parts += [flag, str(value)]
    if args.no_baselines:
        parts.append("--no-baselines")
    if args.cuda_kernel != "auto":
        parts += ["--cuda-kernel", args.cuda_kernel]
    return " ".join([*parts, "--json"])


def machine_name(device: str) -> str:
    """The GPU's name (cuda), else the CPU model."""
    if device == "cuda":
        import torch

        return torch.cuda.get_device_name()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _isal_choice(r: dict) -> str:
    if "isal_encode_slice_bytes" not in r:
        return "-"
    enc, upd = r["isal_encode_slice_bytes"] // _KIB, r["isal_update_slice_bytes"] // _KIB
    return f"{enc}/{upd} ({r['isal_update_method']})"


def print_row(r: dict, *, header: bool) -> None:
    """Print one configuration's figures (after the column header when `header`)."""
    if header:
        print(
            f"{'device':6} {'D':>4} {'H':>3} {'block':>8} | {'encode':>8} {'vs isal':>7} | "
            f"{'update':>8} {'vs isal':>7} | {'rebuild':>9} | {'isal enc':>8} {'isal upd':>8} "
            f"{'zfec enc':>8} {'vs zfec':>8} | isal slices (enc/upd, KiB)"
            "   (GB/s of data; rebuild of H lost pages in ms)"
        )

    def gbps(v):
        return f"{v:8.2f}" if v is not None else "       -"

    print(
        f"{r['device']:6} {r['data_pages']:4} {r['parity_pages']:3} "
        f"{r['block_bytes'] // _KIB:6}Ki | {r['encode_gbps']:8.2f} "
        f"{_ratio(r['encode_gbps'], r['isal_encode_gbps']):>7} | {r['update_gbps']:8.2f} "
        f"{_ratio(r['update_gbps'], r['isal_update_gbps']):>7} | {r['reconstruct_ms']:7.2f}ms | "
        f"{gbps(r['isal_encode_gbps'])} {gbps(r['isal_update_gbps'])} "
        f"{gbps(r['zfec_encode_gbps'])} {_ratio(r['encode_gbps'], r['zfec_encode_gbps']):>8} | "
        f"{_isal_choice(r)}",
        flush=True,
    )
