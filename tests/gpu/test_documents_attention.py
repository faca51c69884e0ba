"""Attention within documents: the CUDA documents path against the dense reference."""

from __future__ import annotations

import pytest
import torch

from unbroken.model import build_model, compile_blocks
from unbroken.model.attention import Documents
from unbroken.model.llama import TransformerArgs

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
ARGS = TransformerArgs(dim=256, n_layers=2, n_heads=8, n_kv_heads=2, ffn_dim=704)


def _batch(lengths: list[int], device):
    gen = torch.Generator().manual_seed(len(lengths))
    n = sum(lengths)
    tokens = torch.randint(0, ARGS.vocab_size, (n,), generator=gen)
    seg = torch.cat([torch.full((k,), i) for i, k in enumerate(lengths)]).int()
    pos = torch.cat([torch.arange(k) for k in lengths])
    return [t.to(device) for t in (tokens, tokens.roll(-1), seg, pos)]


def test_documents_from_segment_ids_equal_those_from_lengths():
    lengths = [5, 1, 9, 3]
    seg = torch.cat([torch.full((k,), i) for i, k in enumerate(lengths)])
    a, b = Documents.of(lengths, seg), Documents.of(None, seg)
    assert torch.equal(a.cu_seqlens, b.cu_seqlens) and a.max_len == b.max_len == 9
    assert a.cu_seqlens.tolist() == [0, 5, 6, 15, 18]
    with pytest.raises(ValueError, match="sum to 17"):
        Documents.of([5, 1, 8, 3], seg)


def _loss_and_grads(model, batch, lengths):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(*batch, doc_lengths=lengths)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("kernel", ["varlen", "flex"])
def test_the_documents_path_matches_the_dense_masked_path(kernel):
    torch.manual_seed(0)
    model = build_model(ARGS, device="cuda")
    model.attention_kernel = kernel
    lengths = [700, 1, 300, 1023, 24, 2048]
    batch = _batch(lengths, "cuda")
    model.dense_attention = True
    dense, dense_g = _loss_and_grads(model, batch, lengths)
    model.dense_attention = False
    docs, docs_g = _loss_and_grads(model, batch, lengths)
    torch.testing.assert_close(docs, dense, rtol=1e-2, atol=1e-2)
    for a, r in zip(docs_g, dense_g, strict=True):
        assert ((a - r).norm() / r.norm()) < 2e-2


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("kernel", ["varlen", "flex"])
def test_the_documents_path_is_deterministic_under_deterministic_algorithms(kernel):
    """Bit-exact recovery needs a redone micro-batch to produce the same gradient bits."""
    torch.use_deterministic_algorithms(True)
    try:
        torch.manual_seed(1)
        model = build_model(ARGS, device="cuda")
        model.attention_kernel = kernel
        lengths = [1500, 500, 2000, 96]
        batch = _batch(lengths, "cuda")
        a = _loss_and_grads(model, batch, lengths)
        b = _loss_and_grads(model, batch, lengths)
        assert torch.equal(a[0], b[0])
        assert all(torch.equal(x, y) for x, y in zip(a[1], b[1], strict=True))
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.mark.gpu
@cuda
def test_compiled_flex_blocks_match_eager_and_do_not_recompile_per_micro_batch():
    torch.manual_seed(2)
    model = build_model(ARGS, device="cuda")
    model.attention_kernel = "flex"
    eager = [_loss_and_grads(model, _batch(ls, "cuda"), ls) for ls in ([512, 512], [1000, 24])]
    compile_blocks(model)
    stats = torch._dynamo.utils.counters["stats"]
    shapes = ([512, 512], [1000, 24], [1, 1, 1022], [1024], [300, 300, 424], [7, 1017])
    runs = [_loss_and_grads(model, _batch(ls, "cuda"), ls) for ls in shapes[:3]]
    graphs = stats["unique_graphs"]
    runs += [_loss_and_grads(model, _batch(ls, "cuda"), ls) for ls in shapes[3:]]
    for (le, ge), (lc, gc) in zip(eager, runs, strict=False):
        torch.testing.assert_close(lc, le, rtol=1e-2, atol=1e-2)
        for a, r in zip(gc, ge, strict=True):
            assert ((a - r).norm() / r.norm()) < 2e-2
    # Other document counts and lengths reuse the graphs compiled so far.
    assert stats["unique_graphs"] == graphs, dict(stats)
