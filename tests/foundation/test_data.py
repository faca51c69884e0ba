import json

import numpy as np
import pytest

from unbroken.data import PackedStream, Sampler, load_corpus
from unbroken.data.packing import IGNORE_INDEX
from unbroken.errors import UserError


@pytest.fixture(scope="module")
def stdlib():
    return load_corpus("stdlib")


def test_stdlib_corpus_is_real_code_of_varied_length(stdlib):
    lengths = stdlib.doc_lengths()
    assert stdlib.n_docs > 500
    assert lengths.min() < 200 < 100_000 < lengths.max()
    assert b"def " in stdlib.tokens[:2_000_000].tobytes()


def test_sampler_is_a_pure_function(stdlib):
    a = Sampler(PackedStream(stdlib, 128, seed=7), n_shards=4, microbatches=3)
    b = Sampler(PackedStream(stdlib, 128, seed=7), n_shards=4, microbatches=3)
    b.get(50, 0, 0)  # different history on b
    for it, shard, mb in [(0, 0, 0), (3, 2, 1), (1000, 3, 2)]:
        x, y = a.get(it, shard, mb), b.get(it, shard, mb)
        assert x.tokens.equal(y.tokens) and x.doc_lengths == y.doc_lengths
    assert not a.get(0, 0, 0).tokens.equal(a.get(0, 1, 0).tokens)
    other_seed = Sampler(PackedStream(stdlib, 128, seed=8), 4, 3)
    assert not other_seed.get(0, 0, 0).tokens.equal(a.get(0, 0, 0).tokens)


def test_packing_keeps_document_boundaries():
    from unbroken.data.corpus import Corpus

    docs = [b"abcde", b"xy", b"0123456789"]
    offsets = np.cumsum([0] + [len(d) for d in docs])
    corpus = Corpus(np.frombuffer(b"".join(docs), np.uint8), offsets, "toy")
    stream = PackedStream(corpus, 8, seed=0)
    seen = []
    for w in range(stream.windows_per_epoch):
        mb = stream.window(w)
        assert mb.n_tokens == 8 and sum(mb.doc_lengths) == 8
        seg, pos, tgt, tok = mb.segment_ids, mb.positions, mb.targets, mb.tokens
        for i in range(7):
            if seg[i] == seg[i + 1]:
                assert tgt[i] == tok[i + 1] and pos[i + 1] == pos[i] + 1
            else:
                assert tgt[i] == IGNORE_INDEX and pos[i + 1] == 0
        assert tgt[7] == IGNORE_INDEX
        seen.append(bytes(tok.numpy().astype(np.uint8)))
    # The windows are consecutive slices of the documents in one permuted order, each cut
    # where the segment lengths say.
    joined = b"".join(seen)
    orders = [b"".join(docs[i] for i in p) for p in __import__("itertools").permutations(range(3))]
    assert any(o.startswith(joined) for o in orders)
    assert len(joined) == 16


def test_user_corpus_folder_and_jsonl(tmp_path):
    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "a.txt").write_text("hello world " * 20)
    (folder / "b.md").write_text("another document " * 30)
    c = load_corpus(str(folder))
    assert c.n_docs == 2
    jl = tmp_path / "docs.jsonl"
    jl.write_text("\n".join(json.dumps({"body": f"doc {i} " * 50}) for i in range(5)))
    c2 = load_corpus(str(jl), jsonl_field="body")
    assert c2.n_docs == 5
    with pytest.raises(UserError, match="field 'text'"):
        load_corpus(str(jl))


def test_missing_corpus_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="corpus path not found"):
        load_corpus(str(tmp_path / "nope"))
