"""Subword tokenization: the BPE trained on the job's corpus (deterministic, cached by corpus and
tokenizer hash), a user's tokenizer.json, the vocabulary each preset resolves to, one-line
errors, and a BPE job that recovers bit-exactly from a kill."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from unbroken.config import DataConfig, JobConfig, ModelConfig
from unbroken.data import PackedStream, corpus_for, load_corpus
from unbroken.data import tokenizer as tk

from .conftest import tiny_job


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A private token cache (UNBROKEN_CACHE), inherited by every process the test starts."""
    path = tmp_path / "cache"
    monkeypatch.setenv("UNBROKEN_CACHE", str(path))
    load_corpus.cache_clear()
    yield path
    load_corpus.cache_clear()


@pytest.fixture(scope="module")
def texts(tmp_path_factory) -> Path:
    """A folder corpus: 60 real standard-library modules (a few MB would only slow the test)."""
    folder = tmp_path_factory.mktemp("texts")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    names = sorted(p.name for p in stdlib.glob("*.py"))[:60]
    for name in names:
        (folder / f"{name}.txt").write_bytes((stdlib / name).read_bytes())
    return folder


def _bpe_data(texts: Path, vocab: int = 320) -> DataConfig:
    return DataConfig(corpus=str(texts), tokenizer="bpe", vocab_size=vocab)


def test_presets_pick_their_tokenizer_and_the_model_vocabulary_follows():
    for preset in ("tiny", "small"):
        job = JobConfig(model=ModelConfig(preset=preset))
        assert (job.data.tokenizer, job.model.vocab_size) == ("bytes", None)
    for preset in ("125m", "350m", "1b"):
        job = JobConfig(model=ModelConfig(preset=preset))
        assert (job.data.tokenizer, job.data.vocab_size, job.model.vocab_size) == (
            "bpe",
            32768,
            32768,
        )
    # Bytes on a BPE preset: the model shrinks to the byte vocabulary.
    job = JobConfig(model=ModelConfig(preset="125m"), data=DataConfig(tokenizer="bytes"))
    assert job.model.vocab_size == 256
    # A BPE on the tiny model: sized by data.vocab_size, or by model.vocab_size.
    job = JobConfig(data=DataConfig(tokenizer="bpe", vocab_size=1000))
    assert job.model.vocab_size == 1000
    job = JobConfig(model=ModelConfig(vocab_size=4096), data=DataConfig(tokenizer="bpe"))
    assert job.data.vocab_size == 4096
    # Resolution is idempotent and leaves its arguments alone.
    data = DataConfig()
    job = JobConfig(model=ModelConfig(preset="1b"), data=data)
    assert data.tokenizer == "auto"
    assert dataclasses.replace(job) == job


def test_the_model_must_cover_the_tokenizer():
    with pytest.raises(ValueError, match=r"model\.vocab_size = 300 is smaller"):
        JobConfig(
            model=ModelConfig(vocab_size=300), data=DataConfig(tokenizer="bpe", vocab_size=500)
        )
    with pytest.raises(ValueError, match=r"data\.vocab_size = 500 sizes a trained BPE"):
        JobConfig(data=DataConfig(tokenizer="bytes", vocab_size=500))
    with pytest.raises(ValueError, match="at least 257"):
        JobConfig(data=DataConfig(tokenizer="bpe", vocab_size=256))
    with pytest.raises(ValueError, match=r"data\.dataset yields its own token ids"):
        JobConfig(data=DataConfig(tokenizer="bpe", dataset="m:C"))


def _train_in_fresh_process(texts: Path, cache: Path, threads: str) -> str:
    """sha256 of the tokenizer.json a new interpreter trains (its own hash-map seeds)."""
    code = (
        "from unbroken.config import DataConfig, JobConfig\n"
        "from unbroken.data import corpus_for\n"
        f"c = corpus_for(JobConfig(data=DataConfig(corpus={str(texts)!r}, tokenizer='bpe', "
        "vocab_size=600)).data)\n"
        "print(c.tokenizer)\n"
    )
    env = {**os.environ, "UNBROKEN_CACHE": str(cache), "RAYON_NUM_THREADS": threads}
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert r.returncode == 0, r.stderr
    (bpe,) = cache.glob("bpe-*.json")
    assert r.stdout.strip() == "bpe:" + tk.text_hash(bpe.read_text())
    return hashlib.sha256(bpe.read_bytes()).hexdigest()


def test_training_the_bpe_is_deterministic(texts, tmp_path):
    one = _train_in_fresh_process(texts, tmp_path / "a", threads="1")
    two = _train_in_fresh_process(texts, tmp_path / "b", threads="2")
    assert one == two
    tokens = [np.load(next((tmp_path / d).glob("tokens-*")) / "tokens.npy") for d in "ab"]
    assert np.array_equal(*tokens)


def test_the_second_load_hits_the_cache(texts, cache, monkeypatch):
    data = JobConfig(data=_bpe_data(texts)).data
    first = corpus_for(data)
    assert first.tokenizer.startswith("bpe:") and first.tokens.dtype == np.uint16
    assert 256 < first.vocab_size <= 320 and int(first.tokens.max()) < first.vocab_size
    folder = next(cache.glob("tokens-*"))
    stamp = (folder / "tokens.npy").stat().st_mtime_ns

    def refuse(*args, **kwargs):
        raise AssertionError("the cache should have answered")

    monkeypatch.setattr(tk, "train_bpe", refuse)
    monkeypatch.setattr(tk, "encode_documents", refuse)
    load_corpus.cache_clear()  # a new process: only the disk cache remains
    second = corpus_for(data)
    assert isinstance(second.tokens, np.memmap)  # mapped read-only, not rebuilt
    assert np.array_equal(first.tokens, second.tokens)
    assert np.array_equal(first.offsets, second.offsets)
    assert (folder / "tokens.npy").stat().st_mtime_ns == stamp
    assert len(list(cache.glob("tokens-*"))) == 1


def test_documents_keep_their_boundaries(texts, cache):
    from tokenizers import Tokenizer

    corpus = corpus_for(JobConfig(data=_bpe_data(texts)).data)
    raw = load_corpus(str(texts))
    assert corpus.n_docs == raw.n_docs
    (bpe,) = cache.glob("bpe-*.json")
    tok = Tokenizer.from_file(str(bpe))
    for d in (0, 7, corpus.n_docs - 1):
        text = raw.tokens[raw.offsets[d] : raw.offsets[d + 1]].tobytes().decode("utf-8")
        ids = corpus.tokens[corpus.offsets[d] : corpus.offsets[d + 1]]
        assert ids.tolist() == tok.encode(text, add_special_tokens=False).ids
        assert tok.decode(ids.tolist()) == text
    # Packed windows cut documents only where the offsets say.
    stream = PackedStream(corpus, 64, seed=0)
    lengths = [n for w in range(stream.windows_per_epoch) for n in stream.window(w).doc_lengths]
    assert sum(lengths) == stream.windows_per_epoch * 64
    assert max(lengths) <= max(corpus.doc_lengths())


def test_a_user_tokenizer_json_is_used(texts, cache, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(
        [p.read_text() for p in sorted(texts.iterdir())[:5]],
        trainers.WordLevelTrainer(vocab_size=200, special_tokens=["[UNK]"]),
    )
    path = tmp_path / "mine" / "tokenizer.json"
    path.parent.mkdir()
    tok.save(str(path))
    job = JobConfig(data=DataConfig(corpus=str(texts), tokenizer=str(path)))
    assert job.data.vocab_size == tok.get_vocab_size() == 200
    assert job.model.vocab_size == 256  # rounded up to a multiple of 64
    corpus = corpus_for(job.data)
    assert corpus.tokenizer.startswith("file:")
    raw = load_corpus(str(texts))
    first = raw.tokens[raw.offsets[0] : raw.offsets[1]].tobytes().decode()
    assert corpus.tokens[: corpus.offsets[1]].tolist() == tok.encode(first).ids


def _unbroken(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "unbroken", *args], capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (None, "data.tokenizer: no file"),
        ("{not json", "is not readable JSON"),
        ('{"version": "1.0"}', "is not a Hugging Face tokenizer.json"),
    ],
)
def test_a_bad_tokenizer_is_one_clear_line(tmp_path, content, needle):
    path = tmp_path / "tokenizer.json"
    if content is not None:
        path.write_text(content)
    cfg = tmp_path / "job.toml"
    cfg.write_text(f"[data]\ntokenizer = {json.dumps(str(path))}\n")
    r = _unbroken("train", "--config", str(cfg), "--out", str(tmp_path / "out"))
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("unbroken: error:"), r.stderr
    assert needle in lines[0] and str(path) in lines[0] and str(cfg) in lines[0]


@pytest.mark.slow  # ~11 s; CI keeps the BPE's determinism and its document boundaries
def test_a_bpe_job_recovers_bit_exact_from_a_kill(texts, cache, tmp_path, monkeypatch):
    from unbroken.api import run_job

    built = []
    encode = tk.encode_documents
    monkeypatch.setattr(tk, "encode_documents", lambda *a: built.append(1) or encode(*a))
    base = tiny_job(iterations=8, inject=["kill:rank=1,iter=4,phase=update"])
    cfg = dataclasses.replace(
        base,
        data=dataclasses.replace(base.data, corpus=str(texts), tokenizer="bpe", vocab_size=320),
    )
    assert cfg.model.vocab_size == 320
    s = run_job(cfg, tmp_path / "run", reference=True, quiet=True)
    assert s["state"] == "done"
    assert s["failures_injected"] == s["failures_recovered"] == 1
    assert s["bit_exact"] is True and s["per_iteration_mismatches"] == []
    assert built == [1]  # tokenized once, in this (the CLI) process, before the ranks started
    assert len(list(cache.glob("tokens-*"))) == 1
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["data"]["tokenizer"] == "bpe" and config["model"]["vocab_size"] == 320
