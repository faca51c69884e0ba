"""The fused chunk transaction (`unbroken.update.transaction`): the plain updater's bits and
parity equal to a fresh encode for every tier shape and kernel form, and a kill inside the
fused kernel or inside the write-back after it repaired and resumed to the uninterrupted bits."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from unbroken.config import ProtectionConfig
from unbroken.engine.replica import build_training
from unbroken.update import PlainUpdater
from unbroken.update.marker import Stage
from unbroken.update.rmu import local_allocator

from ._updater_rig import CFG, LR, PROT, SCALE, cuda
from ._updater_rig import noop as _noop


def _build(prot: ProtectionConfig | None):
    regions: dict[str, torch.Tensor] = {}
    allocate = local_allocator(prot, regions, pin_marker=True) if prot else None
    cfg = dataclasses.replace(CFG, protection=prot or PROT)
    b = build_training(cfg, n_shards=1, device=torch.device("cuda"), allocate=allocate)
    return b, regions


def _iterate(b, upd, iteration: int) -> None:
    gen = torch.Generator().manual_seed(100 + iteration)
    b.state.grads.copy_(torch.randn(b.state.grads.numel(), generator=gen) * 1e-2)
    upd.protect(iteration)
    upd.record_sync(iteration, loss=2.5, grad_norm=1.25, grad_scale=SCALE, lr=LR)
    upd.update(iteration, lr=LR, grad_scale=SCALE, hook=_noop)


def _parity_consistent(upd) -> bool:
    before = upd.model_parity.clone()
    for group in upd.groups:
        group.encode()
    return torch.equal(before, upd.model_parity)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize(
    "h1,h2,planes,block,memory,code",
    [
        (3, 1, 0, 256, "host", "vandermonde"),
        (3, 1, 0, 512, "device", "vandermonde"),
        (2, 1, 0, 128, "host", "vandermonde"),
        (1, 1, 0, 256, "device", "vandermonde"),
        (3, 2, 0, 1024, "host", "vandermonde"),
        (3, 1, 1, 256, "host", "cauchy"),
        (3, 1, 0, 512, "host", "cauchy"),
        (4, 1, 1, 128, "host", "cauchy"),
        (4, 1, 2, 256, "device", "cauchy"),
        (3, 1, 2, 128, "host", "cauchy"),
        (1, 1, 1, 256, "host", "cauchy"),
        (5, 2, 1, 256, "device", "cauchy"),
        (16, 1, 0, 256, "host", "cauchy"),
        (4, 1, 0, 512, "device", "cauchy"),
    ],
)
def test_the_fused_transaction_computes_the_plain_bits_and_the_encoders_parity(
    h1, h2, planes, block, memory, code
):
    """Both parity placements (in host memory the graph writes back on its second stream) and
    both first-tier codes (the Vandermonde one by Horner's rule, `_triton_horner`)."""
    from unbroken.update.graph import GraphUpdater

    prot = dataclasses.replace(
        PROT, parity_pages=h1, second_tier_pages=h2, parity_memory=memory, code=code
    )
    plain, _ = _build(None)
    pu = PlainUpdater(plain.state, plain.geometry, plain.step)
    b, regions = _build(prot)
    tuning = {"planes": planes, "block": block, "warps": 4}
    gu = GraphUpdater(b.state, b.geometry, b.step, regions, prot, fused_tuning=tuning)
    assert gu.fused is not None and gu.fused.planes == (planes if h1 <= 4 else 0)
    assert gu.fused.horner == (code == "vandermonde")
    assert all(g.first_tier_codec.generator == code for g in gu.groups)
    assert gu.model_parity.is_cuda == (memory == "device")
    assert (gu._host is None) == (memory == "device")
    gu.initialize(-1)
    for it in range(3):
        _iterate(plain, pu, it)
        _iterate(b, gu, it)
        assert b.state.state_hash() == plain.state.state_hash(), it
        assert _parity_consistent(gu), it
    assert gu.captures == 1


def _coefficients(upd, iteration: int) -> torch.Tensor:
    from unbroken.update.fused_adamw import AdamWCoefficients

    c = AdamWCoefficients.of(upd.step.optimizer, step=iteration + 1, lr=LR, grad_scale=SCALE)
    return torch.tensor(c.values(), dtype=torch.float32, device="cuda")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("torn", ["step", "writeback"])
@pytest.mark.parametrize("code", ["cauchy", "vandermonde"])
def test_a_kill_inside_the_fused_kernel_or_its_write_back_is_repaired_to_the_same_bits(torn, code):
    """Transaction `target` of iteration 1 is driven by hand with the fused kernel and then
    torn as a kill would tear it: half of the chunk's rows stepped and scratch half stale
    (marker CHUNK_UPDATING), or half of the parity written back (marker PARITY_READY). Either
    way the write-back of the transaction before it is taken back too, as the graph's second
    stream may leave it (parity in host memory, the default). A fresh updater over the same
    memory repairs, resumes, and ends at the uninterrupted run's bits."""
    from unbroken.update.factory import resumable_updater
    from unbroken.update.layout import SEGMENTS

    prot = dataclasses.replace(PROT, code=code)
    ref, ref_regions = _build(prot)
    ru = resumable_updater(ref.state, ref.geometry, ref.step, ref_regions, prot, kind="host")
    ru.initialize(-1)
    for it in range(3):
        _iterate(ref, ru, it)

    b, regions = _build(prot)
    su = resumable_updater(b.state, b.geometry, b.step, regions, prot)
    assert su.fused is not None and su.fused.horner == (code == "vandermonde")
    su.initialize(-1)
    _iterate(b, su, 0)
    gen = torch.Generator().manual_seed(101)
    b.state.grads.copy_(torch.randn(b.state.grads.numel(), generator=gen) * 1e-2)
    su.protect(1)
    su.record_sync(1, loss=2.5, grad_norm=1.25, grad_scale=SCALE, lr=LR)
    su.step.begin_pass(0, b.state, step=2, lr=LR, grad_scale=SCALE)
    target = su.transactions // 2 + 1
    assert not su.model_parity.is_cuda
    x, c = su.chunks[target - 1].byte_lo, su.geometry.chunk_bytes
    previous = su.model_parity[su.chunks[target - 1].group][:, x : x + c].clone()
    for k in range(target):
        su._transaction(1, k, LR, SCALE)
    ref_k, slot = su.chunks[target], su._slot(target)
    su._save_undo(ref_k)
    su._mark(stage=Stage.CHUNK_UPDATING, **su._position(target))
    old = [su._chunk_data(sg, ref_k).clone() for sg in range(SEGMENTS)]
    su.fused.launch(
        ref_k,
        _coefficients(su, 1),
        first_index=su.step.first_index(ref_k),
        decay_end=su.step.decay_end,
        slot=slot,
    )
    half = su.d // 2
    if torn == "step":
        for sg in range(SEGMENTS):  # rows past the first half still hold their old words
            su._chunk_data(sg, ref_k)[half:].copy_(old[sg][half:])
        su.scratch[slot][:, : c // 2].fill_(0xA5)
    else:
        su._mark(stage=Stage.PARITY_READY)
        x = ref_k.byte_lo
        su.model_parity[ref_k.group][:, x : x + c // 2].copy_(su.scratch[slot][:, : c // 2])
    torch.cuda.synchronize()
    x = su.chunks[target - 1].byte_lo  # its write-back had not landed
    su.model_parity[su.chunks[target - 1].group][:, x : x + c].copy_(previous)

    again = resumable_updater(b.state, b.geometry, b.step, regions, prot)
    report = again.repair({})
    want = "restored" if torn == "step" else "rolled"
    assert report.fixup.startswith(want), report
    assert again.marker.state.stage is Stage.SYNCED
    again.update(1, lr=LR, grad_scale=SCALE, hook=_noop)
    assert _parity_consistent(again)
    _iterate(b, again, 2)
    assert b.state.state_hash() == ref.state.state_hash()
    assert _parity_consistent(again)
    assert again.captures == 1
