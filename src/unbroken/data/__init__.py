"""Real-text training data, offline: corpus discovery, tokenization (bytes, or a BPE through
Hugging Face `tokenizers`, cached per corpus and tokenizer), packing into
fixed-budget micro-batches with document boundaries, and a sampler that is a pure function of
(seed, iteration, logical shard, micro-batch index) — a redone iteration gets identical inputs
on any process.
"""

from unbroken.data.corpus import Corpus, corpus_for, load_corpus
from unbroken.data.packing import MicroBatch, PackedStream
from unbroken.data.sampler import Sampler

__all__ = ["Corpus", "MicroBatch", "PackedStream", "Sampler", "corpus_for", "load_corpus"]
