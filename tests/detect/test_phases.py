"""The phased bench workload: same tokens, short-document phases, deterministic."""

import torch

from unbroken.bench.detect_phases import PhasedSource, split_documents
from unbroken.bench.detect_varlen import varlen_loss
from unbroken.config import DataConfig, JobConfig, ModelConfig, TrainConfig
from unbroken.data.packing import IGNORE_INDEX
from unbroken.engine.replica import build_training
from unbroken.train.loop import reference_loss

CFG = JobConfig(
    model=ModelConfig(preset="tiny"),
    data=DataConfig(tokens_per_microbatch=512, microbatches=2, max_documents=200),
    train=TrainConfig(iterations=1),
)


def _built():
    return build_training(CFG, n_shards=1, device=torch.device("cpu"))


def test_split_cuts_documents_and_keeps_tokens():
    mb = _built().source.iteration(0, 0)[0]
    cut = split_documents(mb, 100)
    assert torch.equal(cut.tokens, mb.tokens) and sum(cut.doc_lengths) == mb.n_tokens
    assert max(cut.doc_lengths) <= 100 and len(cut.doc_lengths) >= mb.n_tokens // 100
    starts = torch.cumsum(torch.tensor((0, *cut.doc_lengths[:-1])), 0)
    assert torch.equal(cut.positions[starts], torch.zeros(len(starts), dtype=torch.int64))
    # No target crosses a segment boundary; inside a segment the targets are the original ones.
    ends = starts[1:] - 1
    assert bool((cut.targets[ends] == IGNORE_INDEX).all())
    inside = torch.ones(mb.n_tokens, dtype=torch.bool)
    inside[ends] = False
    assert torch.equal(cut.targets[inside], mb.targets[inside])
    # The cut batch is a valid packed micro-batch: both attention paths agree on it.
    b = _built()
    with torch.no_grad():
        ref = reference_loss(b.model, cut, torch.device("cpu"))
        var = varlen_loss(b.model, cut, torch.device("cpu"))
    torch.testing.assert_close(var, ref, rtol=1e-5, atol=1e-5)


def test_phases_are_deterministic_and_only_short_phases_change():
    src = _built().source
    phased = PhasedSource(src, seed=11, phase_iters=3, short_tokens=64)
    kinds = [phased.short(it) for it in range(30)]
    assert any(kinds) and not all(kinds)
    assert all(kinds[i] == kinds[3 * (i // 3)] for i in range(30))  # constant within a phase
    assert kinds == [PhasedSource(src, 11, 3, 64).short(it) for it in range(30)]
    for it in range(6):
        got, base = phased.iteration(it, 0), src.iteration(it, 0)
        for g, b in zip(got, base, strict=True):
            assert torch.equal(g.tokens, b.tokens)
            if kinds[it]:
                assert max(g.doc_lengths) <= 64
            else:
                assert g.doc_lengths == b.doc_lengths
