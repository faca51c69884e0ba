"""The fused AdamW kernel: the eager update's arithmetic, one launch per chunk or per state."""

from __future__ import annotations

import pytest
import torch

from unbroken.config import DataConfig, JobConfig, ModelConfig, TrainConfig
from unbroken.train.optim import AdamW
from unbroken.update.fused_adamw import AdamWCoefficients, fused_adamw_

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
OPT = AdamW(beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


def _operands(n: int, device, gen) -> list[torch.Tensor]:
    p = torch.randn(n, generator=gen) * 0.02
    g = torch.randn(n, generator=gen) * 1e-3
    m = torch.randn(n, generator=gen) * 1e-4
    v = torch.rand(n, generator=gen) * 1e-6
    return [t.to(device) for t in (p, g, m, v)]


def _eager(ops, decay_end: int, step: int, lr: float, scale: float) -> list[torch.Tensor]:
    out = [t.clone().double() for t in ops]
    lo = [t[:decay_end] for t in out]
    hi = [t[decay_end:] for t in out]
    ref = AdamW(OPT.beta1, OPT.beta2, OPT.eps, OPT.weight_decay)
    ref.update_range(*lo, step=step, lr=lr, grad_scale=scale, decay=True)
    ref.update_range(*hi, step=step, lr=lr, grad_scale=scale, decay=False)
    return out


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("step,scale", [(1, 1.0), (37, 0.31)])
def test_fused_matches_the_eager_update_in_float64_to_fp32_rounding(step, scale):
    gen = torch.Generator().manual_seed(step)
    n, decay_end = 3 * 2**20 + 77, 2**21 + 16
    ops = _operands(n, "cuda", gen)
    ref = _eager(ops, decay_end, step, 3e-4, scale)
    grads = ops[1].clone()
    fused_adamw_(
        *ops,
        AdamWCoefficients.of(OPT, step=step, lr=3e-4, grad_scale=scale),
        first_index=0,
        decay_end=decay_end,
    )
    assert torch.equal(ops[1], grads), "the gradient must stay untouched"
    for got, want in zip((ops[0], ops[2], ops[3]), (ref[0], ref[2], ref[3]), strict=True):
        err = (got.double() - want).norm() / want.norm()
        assert err < 1e-6, err


@pytest.mark.gpu
@cuda
def test_a_chunk_view_updates_exactly_its_elements_with_their_flat_decay():
    """A [rows, cols] strided chunk gets the bits of the same elements updated in one flat
    launch (decay from the flat index), and nothing outside the chunk is written."""
    gen = torch.Generator().manual_seed(5)
    rows, width = 8, 4096
    n = 16 * width
    flat = _operands(n, "cuda", gen)
    chunked = [t.clone() for t in flat]
    coeffs = AdamWCoefficients.of(OPT, step=3, lr=1e-3, grad_scale=0.5)
    decay_end = 5 * width + 1000  # inside the chunk's rows
    fused_adamw_(*flat, coeffs, first_index=0, decay_end=decay_end)
    before = [t.clone() for t in chunked]
    views = [t.view(16, width)[4 : 4 + rows, 1024:2048] for t in chunked]
    fused_adamw_(*views, coeffs, first_index=4 * width + 1024, decay_end=decay_end)
    inside = torch.zeros(16, width, dtype=torch.bool, device="cuda")
    inside[4 : 4 + rows, 1024:2048] = True
    inside = inside.flatten()
    for a, b, old in zip(chunked, flat, before, strict=True):
        assert torch.equal(a[inside], b[inside])
        assert torch.equal(a[~inside], old[~inside])


@pytest.mark.gpu
@cuda
def test_plain_and_chunked_updaters_compute_identical_states_on_the_gpu():
    """[Note: chunk-geometry] on the GPU: the plain updater's one launch over the state and
    the per-chunk launches of `ChunkStep` give the same bits."""
    from unbroken.engine.replica import build_training
    from unbroken.update import PlainUpdater

    cfg = JobConfig(
        model=ModelConfig(preset="small"),
        data=DataConfig(tokens_per_microbatch=256, microbatches=1, max_documents=50),
        train=TrainConfig(iterations=4, device="cuda", precision="fp32"),
    )
    dev = torch.device("cuda")
    states = []
    for whole in (True, False):
        b = build_training(cfg, n_shards=1, device=dev)
        gen = torch.Generator().manual_seed(11)
        b.state.grads.copy_(torch.randn(b.state.grads.numel(), generator=gen) * 1e-2)
        if whole:
            PlainUpdater(b.state, b.geometry, b.step).update(
                0, lr=1e-3, grad_scale=0.7, hook=lambda *a: None
            )
        else:
            for ref in b.geometry.chunks():
                s = b.state
                b.step(
                    ref, s.params, s.grads, s.exp_avg, s.exp_avg_sq, step=1, lr=1e-3, grad_scale=0.7
                )
        states.append(b.state.state_hash())
    assert states[0] == states[1]
