"""Model in flat storage, AdamW on ranges, the schedule, and single-process determinism."""

import math

import torch

from unbroken.config import ModelConfig, TrainConfig
from unbroken.model import FlatLayout, build_model, init_parameters, materialize, resolve_args
from unbroken.train import AdamW, Phase, TrainState, lr_at

from .conftest import local_trainer


def _trainer(seed=0, moe=False, hooks=()):
    from unbroken.config import DataConfig, JobConfig, ProtectionConfig

    cfg = JobConfig(
        model=ModelConfig(preset="tiny", moe_experts=4 if moe else None),
        data=DataConfig(tokens_per_microbatch=64, microbatches=2, max_documents=100),
        train=TrainConfig(iterations=10, lr=1e-3, seed=seed),
        protection=ProtectionConfig(page_bytes=4096, stripe_pages=2, chunk_bytes=1024),
    )
    return local_trainer(cfg, hooks=hooks)[1]


def _tiny_in_flat_storage(std: float, seed: int):
    """The tiny reference model built on meta, materialized into a flat buffer we own."""
    model = build_model(resolve_args(ModelConfig(preset="tiny")), device="meta")
    layout = FlatLayout.of(model)
    flat = torch.zeros(layout.numel)
    materialize(model, layout, flat)
    init_parameters(layout, flat, std=std, seed=seed)
    return model, layout, flat


def test_parameters_are_views_of_caller_storage():
    model, layout, flat = _tiny_in_flat_storage(std=0.006, seed=3)
    lo, hi = flat.data_ptr(), flat.data_ptr() + 4 * layout.numel
    for p in model.parameters():
        assert lo <= p.data_ptr() < hi
    flat.zero_()
    assert all(float(p.detach().abs().sum()) == 0 for p in model.parameters())
    # decayed (matrices) first, norm weights after: one decay range from 0
    ((lo, decay_end),) = layout.decay_ranges()
    assert lo == 0
    assert all(s.decay == (s.offset < decay_end) for s in layout.slots)


def test_init_std_and_norm_ones():
    model = build_model(resolve_args(ModelConfig(preset="small")), device="meta")
    layout = FlatLayout.of(model)
    flat = torch.zeros(layout.numel)
    init_parameters(layout, flat, std=0.006, seed=0)
    mats = flat[: layout.decay_ranges()[0][1]]
    assert abs(float(mats[mats != 0].std()) - 0.006) < 2e-4
    norms = [flat[s.offset : s.offset + s.numel] for s in layout.slots if not s.decay]
    assert all(bool((n == 1).all()) for n in norms)


def test_adamw_matches_torch():
    torch.manual_seed(0)
    p0 = torch.randn(1000)
    grads = [torch.randn(1000) for _ in range(5)]
    ref = torch.nn.Parameter(p0.clone())
    opt = torch.optim.AdamW([ref], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    p, m, v = p0.clone(), torch.zeros(1000), torch.zeros(1000)
    ours = AdamW(beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    for step, g in enumerate(grads, 1):
        ref.grad = g.clone()
        opt.step()
        ours.update_range(p, g, m, v, step=step, lr=1e-2, grad_scale=1.0, decay=True)
    assert torch.allclose(p, ref.detach(), rtol=1e-6, atol=1e-7)


def test_lr_schedule_warmup_then_cosine_to_a_tenth():
    cfg = TrainConfig(iterations=100, lr=1.0)
    assert math.isclose(lr_at(cfg, 0), 0.1)
    assert math.isclose(lr_at(cfg, 9), 1.0)
    assert lr_at(cfg, 50) < 1.0
    assert math.isclose(lr_at(cfg, 99), 0.1, rel_tol=0.01)
    assert min(lr_at(cfg, i) for i in range(100)) >= 0.1 - 1e-12


def test_training_is_deterministic_and_learns():
    hashes = []
    for _ in range(2):
        tr = _trainer()
        losses = [tr.run_iteration(i).loss for i in range(6)]
        hashes.append(tr.state.state_hash())
    assert hashes[0] == hashes[1]
    assert losses[-1] < losses[0]


def test_moe_variant_trains_deterministically():
    a, b = _trainer(moe=True), _trainer(moe=True)
    for i in range(3):
        a.run_iteration(i)
        b.run_iteration(i)
    assert a.state.state_hash() == b.state.state_hash()


def test_phase_hooks_see_every_phase_in_order():
    seen = []
    tr = _trainer(hooks=[lambda ph, it, step, n: seen.append((ph, step, n))])
    tr.run_iteration(0)
    phases = [p for p, _, _ in seen]
    assert phases[:4] == [Phase.FORWARD, Phase.BACKWARD, Phase.FORWARD, Phase.BACKWARD]
    assert phases[4:6] == [Phase.PROTECT, Phase.SYNC]
    assert phases[-1] == Phase.BOUNDARY
    updates = [(s, n) for p, s, n in seen if p is Phase.UPDATE]
    assert len(updates) == updates[0][1] > 1  # chunked update


def test_update_does_not_modify_gradients():
    tr = _trainer()
    state: TrainState = tr.state
    tr.compute(0)
    _, _, scale = tr.sync(0, 0.0)
    assert float(state.grads.abs().sum()) > 0
    before = state.grads.clone()
    tr.updater.update(0, lr=1e-3, grad_scale=scale, hook=tr._hook)
    assert state.grads.equal(before)


def test_chunked_update_equals_one_flat_adamw_step():
    """The striped chunk geometry updates every element exactly once, like a flat AdamW."""
    tr = _trainer()
    s = tr.state
    tr.compute(0)
    _, _, scale = tr.sync(0, 0.0)
    p, m, v = s.params.clone(), s.exp_avg.clone(), s.exp_avg_sq.clone()
    n, ((_, dec),) = s.layout.numel, s.layout.decay_ranges()
    opt = tr.updater.step.optimizer
    for lo, hi, decay in ((0, dec, True), (dec, n, False)):
        opt.update_range(
            p[lo:hi],
            s.grads[lo:hi],
            m[lo:hi],
            v[lo:hi],
            step=1,
            lr=1e-3,
            grad_scale=scale,
            decay=decay,
        )
    tr.updater.update(0, lr=1e-3, grad_scale=scale, hook=tr._hook)
    assert torch.allclose(s.params[:n], p[:n], rtol=1e-6, atol=1e-9)
    assert torch.allclose(s.exp_avg_sq[:n], v[:n], rtol=1e-6, atol=1e-12)


def test_attention_stays_within_each_document():
    from unbroken.data.packing import IGNORE_INDEX, segment_layout

    model, _, _ = _tiny_in_flat_storage(std=0.02, seed=0)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (24,), generator=gen)
    targets = torch.randint(0, 256, (24,), generator=gen)
    targets[:10] = IGNORE_INDEX  # the loss is the second document's alone
    other = tokens.clone()
    other[:10] = torch.randint(0, 256, (10,), generator=gen)  # another first document

    def loss(tok, lengths):
        seg, pos = segment_layout(lengths)
        return model(tok, targets, seg, pos)

    with torch.no_grad():
        assert torch.equal(loss(tokens, [10, 14]), loss(other, [10, 14]))
        # One document: the second part now sees the first, and its loss changes.
        assert not torch.equal(loss(tokens, [24]), loss(other, [24]))
