"""Subword tokenizers for the corpus, through the Hugging Face `tokenizers` library: a
byte-level BPE trained on the job's own corpus, or any `tokenizer.json` the user names.

The BPE is GPT-2's byte-level scheme: text is split by the ByteLevel pre-tokenizer's regex,
every byte maps to one of 256 printable symbols (so any input encodes, no unknown token), and
merges are learned up to the asked vocabulary. No special tokens: document boundaries are kept
by the packing as segments (`unbroken.data.packing`), not by separator ids. Documents are
decoded as UTF-8 with invalid bytes replaced (U+FFFD) before encoding; the byte-level path
(`unbroken.data.corpus`) keeps raw bytes.

Training is deterministic: the trainer has no randomness and, without a continuing-subword
prefix, no id depends on hash-map order (the order-dependence reported for WordPiece's `##`
tokens, huggingface/tokenizers#1794, does not arise); a test trains twice in separate processes
and compares the files' hashes. Nothing here caches: `unbroken.data.corpus` keys the trained
tokenizer and the token ids by corpus and tokenizer hash.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from unbroken.errors import UserError

__all__ = ["ENCODE_BATCH", "encode_documents", "load_tokenizer_json", "text_hash", "train_bpe"]

ENCODE_BATCH = 64
"""Documents per `encode_batch` call: the library encodes a batch in parallel, and only the
ids of one batch are held as Python objects at a time."""


def text_hash(text: str) -> str:
    """First 16 hex digits of the sha256 of a tokenizer's JSON: its identity in cache keys."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def _texts(docs: Sequence[bytes]) -> Iterator[str]:
    for d in docs:
        yield bytes(d).decode("utf-8", errors="replace")


def train_bpe(docs: Sequence[bytes], vocab_size: int) -> str:
    """Train a byte-level BPE with `vocab_size` ids (fewer if the corpus runs out of pairs) on
    the documents; returns its `tokenizer.json` text.

    Args:
        docs: the documents' UTF-8 bytes.
        vocab_size: target number of token ids, at least 257.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    tok.train_from_iterator(_texts(docs), trainer, length=len(docs))
    return tok.to_str()


def load_tokenizer_json(path: Path) -> str:
    """The text of a user's `tokenizer.json`, checked to load in the library.

    Raises:
        UserError: the file is missing or the library cannot read it.
    """
    from tokenizers import Tokenizer

    try:
        text = path.read_text(encoding="utf-8")
        Tokenizer.from_str(text)
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"data.tokenizer: cannot read {path} ({exc})") from None
    except Exception as exc:  # the library raises a bare Exception for a malformed file
        raise UserError(f"data.tokenizer: {path} is not a usable tokenizer.json ({exc})") from None
    return text


def encode_documents(tokenizer_json: str, docs: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """Encode every document on its own (no special tokens added).

    Returns:
        (tokens, offsets): the ids back to back (uint16 when the vocabulary fits, else uint32)
        and int64 offsets of length len(docs) + 1, as `Corpus` holds them.
    """
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tokenizer_json)
    dtype = np.uint16 if tok.get_vocab_size(with_added_tokens=True) <= 1 << 16 else np.uint32
    lengths = np.zeros(len(docs), dtype=np.int64)
    parts: list[np.ndarray] = []
    for start in range(0, len(docs), ENCODE_BATCH):
        batch = list(_texts(docs[start : start + ENCODE_BATCH]))
        for i, enc in enumerate(tok.encode_batch_fast(batch, add_special_tokens=False)):
            ids = np.asarray(enc.ids, dtype=dtype)
            lengths[start + i] = len(ids)
            parts.append(ids)
    offsets = np.zeros(len(docs) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)
    return tokens, offsets
