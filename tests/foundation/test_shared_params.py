"""Shared (tied), frozen and no-decay parameters in flat storage, in one process: the layout
stores a shared parameter once, `materialize` keeps it shared, frozen parameters never change,
no-decay patterns reach the chunked update, and the plain and resumable updaters stay
bit-identical (also through a crash in the update, repaired and resumed)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from unbroken.config import DataConfig, JobConfig, ModelConfig, ProtectionConfig, TrainConfig
from unbroken.engine.replica import build_training
from unbroken.model import FlatLayout, build_model, resolve_args
from unbroken.train import Phase, Trainer
from unbroken.update import ChunkStep, PlainUpdater
from unbroken.update.layout import RetainedLayout
from unbroken.update.marker import Stage
from unbroken.update.rmu import ResumableUpdater, state_from_regions

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tied_model"
PROT = ProtectionConfig(page_bytes=4096, stripe_pages=2, parity_pages=3, chunk_bytes=1024)


def _job(**factory_args) -> JobConfig:
    return JobConfig(
        model=ModelConfig(factory="tied_model:build", factory_args={"dim": 32, **factory_args}),
        data=DataConfig(dataset="tied_model:ArithmeticDataset", tokens_per_microbatch=32),
        train=TrainConfig(iterations=6, lr=3e-3, no_decay=["embed.weight"]),
        protection=PROT,
    )


def _trainer(cfg: JobConfig, allocate=None, make_updater=None, hooks=()):
    built = build_training(
        cfg, n_shards=1, device=torch.device("cpu"), search=[str(EXAMPLE)], allocate=allocate
    )
    make_updater = make_updater or PlainUpdater
    tr = Trainer(
        model=built.model,
        state=built.state,
        source=built.source,
        shard=0,
        cfg=cfg.train,
        group=None,
        device=torch.device("cpu"),
        hooks=list(hooks),
        updater=make_updater(built.state, built.geometry, built.step),
        loss_fn=built.loss_fn,
    )
    return built, tr


def test_a_tied_reference_model_stores_the_shared_weight_once():
    plain = FlatLayout.of(build_model(resolve_args(ModelConfig(preset="tiny"))))
    args = resolve_args(ModelConfig(preset="tiny", tie_embeddings=True))
    tied = FlatLayout.of(build_model(args), tied=args.tied)
    (shared,) = [s for s in tied.slots if s.aliases]
    assert shared.names == ("embed.weight", "head.weight")
    assert plain.numel - tied.numel == args.vocab_size * args.dim
    assert not tied.copies


def test_a_module_used_twice_and_a_tied_head_train_as_one_parameter_each():
    built, tr = _trainer(_job())
    m = built.model
    assert m.head.weight is m.embed.weight
    assert m.blocks[0] is m.blocks[1]
    layout = built.state.layout
    names = {n for s in layout.slots for n in s.names}
    assert {"head.weight", "blocks.1.up.weight"} <= names
    assert len(layout.slots) == len(list(m.parameters()))  # one slot per parameter
    before = m.embed.weight.detach().clone()
    for it in range(2):
        tr.run_iteration(it)
    assert m.head.weight is m.embed.weight  # still one parameter, in flat storage
    assert not torch.equal(before, m.embed.weight.detach())
    lo, hi = built.state.params.data_ptr(), built.state.params.data_ptr() + 4 * layout.numel
    assert all(lo <= p.data_ptr() < hi for p in m.parameters())


def test_frozen_parameters_are_stored_but_never_updated():
    built, tr = _trainer(_job(freeze_positions=True))
    layout, state = built.state.layout, built.state
    ((a, b),) = layout.frozen_ranges()
    (frozen,) = [s for s in layout.slots if not s.trainable]
    assert frozen.name == "positions" and not built.model.positions.requires_grad
    initial = state.params[a:b].clone()
    assert float(initial.abs().sum()) > 0  # the factory's values were copied in
    trained = [s for s in layout.slots if s.trainable]
    before = {s.name: state.params[s.offset : s.offset + s.numel].clone() for s in trained}
    for it in range(3):
        tr.run_iteration(it)
    assert torch.equal(state.params[a:b], initial)
    assert float(state.exp_avg[a:b].abs().sum()) == 0 == float(state.grads[a:b].abs().sum())
    changed = [
        s.name
        for s in trained
        if not torch.equal(before[s.name], state.params[s.offset : s.offset + s.numel])
    ]
    assert len(changed) == len(trained)


def test_no_decay_patterns_reach_the_chunked_update():
    cfg = _job()
    built, _ = _trainer(cfg)
    layout = built.state.layout
    embed = next(s for s in layout.slots if s.name == "embed.weight")
    assert not embed.decay and next(s for s in layout.slots if s.name == "mix.weight").decay
    # one step with zero gradients: only decay moves a parameter, by exactly (1 - lr * wd)
    state, step = built.state, built.step
    state.grads.zero_()
    before = state.params.clone()
    lr = 0.5
    for ref in built.geometry.chunks():
        step(ref, state.params, state.grads, state.exp_avg, state.exp_avg_sq, step=1, lr=lr,
             grad_scale=1.0)  # fmt: skip
    factor = torch.tensor(1.0 - lr * cfg.train.weight_decay, dtype=torch.float32)
    for s in layout.slots:
        got, was = (t[s.offset : s.offset + s.numel] for t in (state.params, before))
        assert torch.equal(got, was * factor if s.decay else was), s.name


def test_chunk_step_masks_follow_arbitrary_ranges():
    from unbroken.train.optim import AdamW
    from unbroken.update import StateGeometry

    geo = StateGeometry(numel=4096, page_bytes=4096, stripe_pages=2, chunk_bytes=1024)
    opt = AdamW(beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    decay, frozen = ((0, 100), (300, 1500)), ((50, 60), (2000, 2100))
    step = ChunkStep(geo, opt, decay, frozen)
    gen = torch.Generator().manual_seed(0)
    p, g = (torch.randn(geo.padded_numel, generator=gen) for _ in range(2))
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    p0 = p.clone()
    for ref in geo.chunks():
        step(ref, p, g, m, v, step=1, lr=1e-2, grad_scale=1.0)
    ref_p, ref_m, ref_v = p0.clone(), torch.zeros_like(p), torch.zeros_like(p)
    idx = torch.arange(p.numel())
    in_decay = torch.zeros_like(idx, dtype=torch.bool)
    for lo, hi in decay:
        in_decay |= (idx >= lo) & (idx < hi)
    ref_p[in_decay] *= 1 - 1e-2 * 0.1
    opt.update_range(ref_p, g, ref_m, ref_v, step=1, lr=1e-2, grad_scale=1.0, decay=False)
    for lo, hi in frozen:
        ref_p[lo:hi], ref_m[lo:hi], ref_v[lo:hi] = p0[lo:hi], 0.0, 0.0
    assert torch.equal(p, ref_p) and torch.equal(m, ref_m) and torch.equal(v, ref_v)


def _resumable(regions):
    fresh = not regions

    def allocate(layout, geometry, device):
        if not regions:
            for s in RetainedLayout.of(geometry, PROT).regions():
                regions[s.name] = torch.zeros(s.nbytes, dtype=torch.uint8)
        return state_from_regions(layout, geometry, regions), fresh

    def make(state, geometry, step):
        return ResumableUpdater(state, geometry, step, regions, PROT, backend="numpy")

    return allocate, make


class _Crash(Exception):
    pass


@pytest.mark.parametrize("freeze", [False, True])
def test_plain_and_resumable_updaters_stay_bit_identical_through_a_crash(freeze):
    cfg = _job(freeze_positions=freeze)
    plain, tr = _trainer(cfg)
    hashes = []
    for it in range(4):
        tr.run_iteration(it)
        hashes.append(plain.state.state_hash())

    regions: dict[str, torch.Tensor] = {}
    allocate, make = _resumable(regions)

    def crash(phase, it, step, n):
        if phase is Phase.UPDATE and it == 2 and step == n // 2:
            raise _Crash

    built, tr = _trainer(cfg, allocate, make, hooks=[crash])
    tr.updater.initialize(done_iter=-1)
    for it in range(2):
        tr.run_iteration(it)
        assert built.state.state_hash() == hashes[it]
    with pytest.raises(_Crash):
        tr.run_iteration(2)
    # a replacement trainer: reattach to the same regions, repair, finish the update, go on
    allocate, make = _resumable(regions)
    built, tr = _trainer(cfg, allocate, make)
    tr.updater.repair({})
    st = tr.updater.marker.state
    assert st.stage is Stage.SYNCED and st.iteration == 2
    tr.updater.update(2, lr=st.lr, grad_scale=st.grad_scale, hook=lambda *a: None)
    assert built.state.state_hash() == hashes[2]
    tr.run_iteration(3)
    assert built.state.state_hash() == hashes[3]


def test_the_example_config_loads():
    from unbroken.config import load_config

    cfg = load_config(JobConfig, EXAMPLE / "config.toml")
    assert cfg.train.no_decay == ["embed.weight"]
    assert dataclasses.asdict(cfg)["model"]["factory_args"]["freeze_positions"] is True


def test_the_tied_reference_model_trains_data_parallel_style():
    from .conftest import local_trainer, tiny_job

    cfg = tiny_job()
    cfg = dataclasses.replace(cfg, model=ModelConfig(preset="tiny", tie_embeddings=True))
    built, tr = local_trainer(cfg)
    losses = [tr.run_iteration(it).loss for it in range(4)]
    assert built.model.head.weight is built.model.embed.weight
    assert losses[-1] < losses[0]
    # the default stays untied: every existing state hash is unchanged
    assert ModelConfig().tie_embeddings is False
