"""Pre-pay, in a shadow, the first-use costs a promoted trainer would otherwise pay inside
recovery (Leto §6: L2 is the device runtime *and its library handles*).

On a GPU the first recovery through an L3 shadow spent ~0.75 s of its 0.93 s finishing the
interrupted update (bench/results/recovery-h200.md): the erasure codec's GPU kernels and
cuBLAS are loaded per process on first use. `warm_cuda` runs each once on scratch memory of
the job's own group shapes (same page size, same D / H1 / H2), then returns the memory to the
device, so what the shadow keeps is the loaded code and the handles, not the scratch pages.
"""

from __future__ import annotations

import time

import torch

from unbroken.config import JobConfig
from unbroken.erasure import ErasureGeometry, PageTable, ProtectionGroup

__all__ = ["warm_cuda"]


def _warm_codec(page_bytes: int, d: int, h1: int, h2: int, chunk: int, device) -> None:
    pages = torch.zeros((d + h1 + h2, page_bytes), dtype=torch.uint8, device=device)
    group = ProtectionGroup(
        ErasureGeometry(page_bytes=page_bytes, data_pages=d, parity_pages=h1, second_tier_pages=h2),
        [pages[i] for i in range(d)],
        [pages[d + i] for i in range(h1)],
        [pages[d + h1 + i] for i in range(h2)],
        name="warm-up",
    )
    group.encode()
    undo = torch.zeros((d, chunk), dtype=torch.uint8, device=device)
    scratch = torch.zeros((h1 + h2, chunk), dtype=torch.uint8, device=device)
    s1 = PageTable([scratch[r] for r in range(h1)])
    s2 = PageTable([scratch[h1 + r] for r in range(h2)])
    # The chunk transaction's two parity updates, exactly as the resumable updater runs them.
    group.first_tier_codec.update_from_old_new(
        s1, PageTable([undo[i] for i in range(d)]), group.data.slice(0, chunk)
    )
    group.second_tier_codec.update_from_old_new(s2, group.first_tier.slice(0, chunk), s1)
    group.reconstruct({0, d})  # a data page and a first-tier parity page


def warm_cuda(cfg: JobConfig, device: torch.device) -> float:
    """Load cuBLAS (a bf16 GEMM, forward and backward) and the codec kernels for the job's
    model and gradient groups on `device`; returns the seconds taken."""
    t0 = time.perf_counter()
    x = torch.randn(64, 64, device=device, requires_grad=True)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        (x @ x).float().sum().backward()
    p = cfg.protection
    for d in (3 * p.stripe_pages, p.stripe_pages):  # model groups, gradient groups
        _warm_codec(p.page_bytes, d, p.parity_pages, p.second_tier_pages, p.chunk_bytes, device)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()  # keep the loaded code and handles, not the scratch pages
    return time.perf_counter() - t0
