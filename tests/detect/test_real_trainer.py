"""One tiny in-process iteration of the real trainer with the PhaseTimer hook (no processes)."""

import dataclasses

import pytest
import torch

from unbroken.bench.detect_varlen import varlen_loss
from unbroken.config import DataConfig, JobConfig, ModelConfig, TrainConfig
from unbroken.detect.timing import PhaseTimer
from unbroken.engine.replica import build_training
from unbroken.train.loop import reference_loss

from ..foundation.conftest import local_trainer

CFG = JobConfig(
    model=ModelConfig(preset="tiny"),
    data=DataConfig(tokens_per_microbatch=256, microbatches=3, max_documents=200),
    train=TrainConfig(iterations=1),
)


def test_phase_timer_records_a_real_iteration():
    timer = PhaseTimer(rank=0)
    _, trainer = local_trainer(CFG, hooks=[timer], loss_fn=varlen_loss)
    res = trainer.run_iteration(0)
    (rec,) = timer.records
    # One replica: no all-reduce hook ends the last micro-batch, so it is not timed.
    assert rec.iteration == 0 and len(rec.mb_s) == 2 and len(rec.forward_s) == 3
    assert all(s > 0 for s in rec.mb_s) and rec.compute_s >= sum(rec.mb_s)
    assert rec.comm_s == 0.0
    assert len(res.doc_lengths) == 3


def test_varlen_loss_equals_the_masked_reference_loss():
    b = build_training(CFG, n_shards=1, device=torch.device("cpu"))
    cpu = torch.device("cpu")
    for mb in b.source.iteration(0, 0):
        with torch.no_grad():
            ref = reference_loss(b.model, mb, cpu)
            var = varlen_loss(b.model, mb, cpu)
        torch.testing.assert_close(var, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_varlen_kernel_on_gpu_matches_the_masked_reference_loss_and_gradients():
    """The GPU path (one FlashAttention varlen call for all documents) computes the same loss
    and gradients as the dense block-diagonal reference, within bf16 tolerance."""
    cuda = torch.device("cuda")
    cfg = dataclasses.replace(
        CFG, data=DataConfig(tokens_per_microbatch=4096, microbatches=2, max_documents=200)
    )
    b = build_training(cfg, n_shards=1, device=cuda)
    params = [p for p in b.model.parameters() if p.requires_grad]
    # The first iteration with a multi-document micro-batch (the corpus is this interpreter's
    # standard library, which differs between machines).
    batches = next(
        bs
        for bs in (b.source.iteration(i, 0) for i in range(50))
        if any(len(mb.doc_lengths) > 1 for mb in bs)
    )
    for mb in batches:
        grads = []
        for fn in (reference_loss, varlen_loss):
            b.model.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = fn(b.model, mb, cuda)
            loss.backward()
            grads.append((loss.detach(), [p.grad.clone() for p in params]))
        (ref, ref_g), (var, var_g) = grads
        torch.testing.assert_close(var, ref, rtol=2e-2, atol=2e-2)
        for a, r in zip(var_g, ref_g, strict=True):
            torch.testing.assert_close(a, r, rtol=5e-2, atol=5e-3)
