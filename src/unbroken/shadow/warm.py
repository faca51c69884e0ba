"""Pre-pay, in a shadow, the first-use costs a promoted trainer would otherwise pay inside
recovery (Leto §6: L2 is the device runtime *and its library handles*).

On a GPU the first recovery through an L3 shadow spent ~0.75 s of its 0.93 s finishing the
interrupted update, and redoing one iteration in the fresh process took 1.0-1.5 s
(bench/results/recovery-h200.md): the erasure codec's GPU kernels, cuBLAS, the model's
kernels and the update's Triton kernel are loaded (or compiled) per process on first use. `warm_cuda` runs each once on
scratch memory of the job's own shapes (a one-layer copy of the model on one micro-batch; the
codec's groups with the same page size and D / H1 / H2), then returns the memory to the
device, so what the shadow keeps is the loaded code and the handles, not the scratch pages.
"""

from __future__ import annotations

import time

import torch

from unbroken.config import JobConfig
from unbroken.erasure import ErasureGeometry, PageTable, ProtectionGroup
from unbroken.update.geometry import StateGeometry
from unbroken.update.layout import RetainedLayout

__all__ = ["warm_cuda"]


def _warm_codec(geometry: ErasureGeometry, chunk: int, device) -> None:
    d, h1, h2 = geometry.data_pages, geometry.parity_pages, geometry.second_tier_pages
    pages = torch.zeros((d + h1 + h2, geometry.page_bytes), dtype=torch.uint8, device=device)
    group = ProtectionGroup(
        geometry,
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
    if hasattr(group.first_tier_codec, "update_from_old_new_ptrs"):
        # The same two updates over device pointer tables, as the stream and graph updaters
        # launch them (`unbroken.update.stream`): another kernel variant than the above.
        def ptrs(table: PageTable) -> torch.Tensor:
            return torch.tensor([int(p) for p in table.ptrs], dtype=torch.int64, device=device)

        old = ptrs(PageTable([undo[i] for i in range(d)]))
        group.first_tier_codec.update_from_old_new_ptrs(
            old, ptrs(group.data.slice(0, chunk)), ptrs(s1), length=chunk
        )
        group.second_tier_codec.update_from_old_new_ptrs(
            ptrs(group.first_tier.slice(0, chunk)), ptrs(s1), ptrs(s2), length=chunk
        )
    group.reconstruct({0, d})  # a data page and a first-tier parity page


def _warm_model(cfg: JobConfig, device: torch.device) -> None:
    """One forward and backward of a one-layer copy of the reference model on a micro-batch
    of the job's shape, under the job's autocast: cuBLAS / cuBLASLt handles and the kernels of
    attention, norms and the loss, for the shapes the promoted trainer will run."""
    import dataclasses

    from unbroken.model import build_model, resolve_args

    args = dataclasses.replace(resolve_args(cfg.model), n_layers=1)
    model = build_model(args, device=device)
    n = cfg.data.tokens_per_microbatch
    tokens = torch.randint(0, args.vocab_size, (n,), device=device)
    segments = torch.arange(n, device=device) // max(1, n // 4)
    positions = torch.arange(n, device=device) % max(1, n // 4)
    bf16 = cfg.train.precision in ("auto", "bf16")
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
        loss = model(tokens, tokens, segments, positions)
    loss.backward()
    del model, loss


def _warm_update(cfg: JobConfig, geometry: StateGeometry, device: torch.device) -> None:
    """The update phase's fused AdamW kernels (`unbroken.update.fused_adamw`), which Triton
    compiles on first use: one chunk-shaped launch, as the resumable updater's `ChunkStep`
    runs it, the same with the scalars on the device, as the graph updater captures it, and
    one over a flat range, as the plain updater does."""
    from unbroken.train.optim import AdamW
    from unbroken.update.fused_adamw import (
        AdamWCoefficients,
        fused_adamw_,
        fused_adamw_dev_,
        fused_available,
    )
    from unbroken.update.kernel import ChunkStep

    if not fused_available():
        return
    opt = AdamW.from_config(cfg.train)
    n = geometry.padded_numel
    bufs = [torch.zeros(n, dtype=torch.float32, device=device) for _ in range(4)]
    step = ChunkStep(geometry, opt, [(0, n // 2)])
    ref = geometry.chunks()[0]
    step(ref, *bufs, step=1, lr=0.0, grad_scale=1.0)
    coeffs = AdamWCoefficients.of(opt, step=1, lr=0.0, grad_scale=1.0)
    on_device = torch.tensor(coeffs.values(), dtype=torch.float32, device=device)
    views = [geometry.chunk_view(t, ref) for t in bufs]
    fused_adamw_dev_(*views, on_device, first_index=step.first_index(ref), decay_end=n // 2)
    fused_adamw_(*bufs, coeffs, first_index=0, decay_end=n // 2)


def _warm_transaction(protection, geometry: StateGeometry, device: torch.device) -> None:
    """The fused chunk transaction (`unbroken.update.transaction`), the graph updater's step,
    which Triton compiles on first use (about 0.5 s, more with a cold disk cache): one launch
    on chunk 0 of a one-stripe state of the job's tiers, chunk shape and parity memory, with
    the default tuning. Its integer arguments (a chunk's words, the rows' strides, the stripe) and its
    pointers' alignment are those of the updater's launches, so Triton's specialization key is
    the same and the promoted trainer's first capture finds the kernel loaded."""
    from unbroken.update.transaction import FusedTransaction, fused_capable

    h1, h2 = protection.parity_pages, protection.second_tier_pages
    if not fused_capable(h1, h2):
        return
    n = geometry.padded_numel
    segments = tuple(torch.zeros(n, dtype=torch.float32, device=device) for _ in range(4))
    shape = (1, h1 + h2, geometry.page_bytes)
    if protection.parity_memory == "host":  # read in place, as the job's host parity
        parity = torch.zeros(shape, dtype=torch.uint8, pin_memory=True)
    else:
        parity = torch.zeros(shape, dtype=torch.uint8, device=device)
    scratch = torch.zeros((1, h1 + h2, geometry.chunk_bytes), dtype=torch.uint8, device=device)
    tx = FusedTransaction(geometry, segments, parity, scratch, h1, h2, generator=protection.code)
    coeffs = torch.zeros(8, dtype=torch.float32, device=device)
    tx.launch(geometry.chunks()[0], coeffs, first_index=0, decay_end=n)


def _warm_marker(device: torch.device) -> None:
    """The stream-ordered marker writes (`unbroken.update.device_marker`): both Triton kernels
    and the CRC table, into pinned scratch pages (the promoted trainer registers its own region)."""
    from unbroken.update.device_marker import DeviceMarker
    from unbroken.update.layout import MARKER_PAGE
    from unbroken.update.marker import MarkerState

    pages = torch.zeros((3, MARKER_PAGE), dtype=torch.uint8, pin_memory=True)
    marker = DeviceMarker(pages, device)
    marker.write(MarkerState(seq=1))
    base = torch.tensor([*marker.base_words(MarkerState(seq=1)), 0], device=device)
    marker.write_at(base, seq_off=1, stage=0, group=0, chunk=0, idle=False)  # the graph's


def warm_cuda(cfg: JobConfig, device: torch.device) -> float:
    """Load cuBLAS and the model's kernels (`_warm_model`), the codec kernels for the job's
    model and gradient groups, the update's kernel (`_warm_update`), the stream's marker
    write (`_warm_marker`) and the fused chunk transaction (`_warm_transaction`) on `device`;
    returns the seconds taken."""
    t0 = time.perf_counter()
    if not cfg.model.factory:
        _warm_model(cfg, device)
    p = cfg.protection.resolved(device.type == "cuda")
    # The layout of a one-stripe state: its groups have the job's D / H1 / H2 and page size.
    geometry = StateGeometry(
        numel=1, page_bytes=p.page_bytes, stripe_pages=p.stripe_pages, chunk_bytes=p.chunk_bytes
    )
    layout = RetainedLayout.of(geometry, p)
    for kind in ("model", "grads"):
        _warm_codec(layout.erasure(kind), p.chunk_bytes, device)
    if device.type == "cuda":
        _warm_update(cfg, geometry, device)
        from unbroken.update.fused_adamw import fused_available

        if fused_available():  # Triton: the stream updater runs (unbroken.update.stream)
            _warm_marker(device)
            _warm_transaction(p, geometry, device)
            if p.lend_activations:  # the lending pool's allocator: built and loaded
                from unbroken.update.lending import library, mark_warmed

                library()
                if not cfg.model.factory:  # the model's kernels ran: its lasting buffers exist
                    mark_warmed()
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()  # keep the loaded code and handles, not the scratch pages
    return time.perf_counter() - t0
