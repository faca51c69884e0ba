"""How a job's tokenizer and its model's vocabulary agree: resolved once, when `JobConfig` is
built, so every process of the job reads the same settings from its spec.

- `data.tokenizer = "auto"` becomes "bpe" for a preset whose vocabulary exceeds the byte
  vocabulary (125m, 350m, 1b: `unbroken.config.presets`) and "bytes" otherwise (tiny, small, a
  user model, a user dataset).
- "bytes": the model's vocabulary is `BYTE_VOCAB` unless `model.vocab_size` says otherwise.
- "bpe": the BPE is trained to `data.vocab_size` ids (0: `model.vocab_size`, else the preset's,
  else `BPE_VOCAB`), and the model's vocabulary is that size unless `model.vocab_size` is set
  (it must then be at least as large).
- a path: a Hugging Face `tokenizer.json`; the path becomes absolute (trainers may run
  elsewhere), its size is read from the file, and the model's vocabulary is that size rounded up
  to a multiple of `VOCAB_MULTIPLE` unless `model.vocab_size` is set (at least as large).

Only the choice and the sizes are decided here, from the config and the tokenizer file; training
the BPE and tokenizing the corpus belong to `unbroken.data` (cached by corpus and tokenizer hash,
done by the CLI before any rank starts). Errors are `ValueError`s naming the key to fix; the
loader adds the config file.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, TypeVar

from unbroken.config.presets import BPE_VOCAB, BYTE_VOCAB, preset_vocab

__all__ = [
    "MIN_BPE_VOCAB",
    "TOKENIZER_KEYWORDS",
    "VOCAB_MULTIPLE",
    "resolve_vocabulary",
    "tokenizer_file_vocab",
]

TOKENIZER_KEYWORDS = ("auto", "bytes", "bpe")
"""Values of `data.tokenizer` that are not a path."""

MIN_BPE_VOCAB = BYTE_VOCAB + 1
"""A byte-level BPE starts from the 256 byte symbols; it needs room for at least one merge."""

VOCAB_MULTIPLE = 64
"""A model sized from a tokenizer file rounds its vocabulary up to this (GPT-2's 50257 becomes
50304), so the output head splits evenly over tensor-parallel ranks."""

M = TypeVar("M")
D = TypeVar("D")

_CHOICES = "'bytes', 'bpe' or the path of a tokenizer.json"


def tokenizer_file_vocab(path: Path) -> int:
    """Number of token ids of a Hugging Face `tokenizer.json`: one past the largest id of its
    model's vocabulary and its added tokens (what `Tokenizer.get_vocab_size()` counts).

    Raises:
        ValueError: the file is missing, not JSON, or not a tokenizer.json.
    """
    if not path.is_file():
        raise ValueError(f"data.tokenizer: no file {path} (set it to {_CHOICES})")
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        vocab: Any = doc["model"]["vocab"]
        ids = list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab)))
        ids += [t["id"] for t in doc.get("added_tokens") or ()]
        size = max(ids) + 1
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"data.tokenizer: {path} is not readable JSON ({exc})") from None
    except (KeyError, TypeError, ValueError):
        raise ValueError(
            f"data.tokenizer: {path} is not a Hugging Face tokenizer.json (no model.vocab); "
            "save one with tokenizers' Tokenizer.save()"
        ) from None
    return int(size)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def resolve_vocabulary(model: M, data: D) -> tuple[M, D]:
    """`model` and `data` with `data.tokenizer`, `data.vocab_size` and `model.vocab_size`
    settled (see the module docstring); the arguments are not modified. Idempotent: resolved
    configs resolve to themselves.

    Args:
        model: the job's `ModelConfig`.
        data: the job's `DataConfig`.

    Raises:
        ValueError: inconsistent settings or an unusable tokenizer file, naming the key.
    """
    tokenizer, data_vocab, model_vocab = _resolve(
        model.preset, model.factory is not None, model.vocab_size, data
    )
    if (tokenizer, data_vocab) != (data.tokenizer, data.vocab_size):
        data = dataclasses.replace(data, tokenizer=tokenizer, vocab_size=data_vocab)
    if model_vocab != model.vocab_size:
        model = dataclasses.replace(model, vocab_size=model_vocab)
    return model, data


def _resolve(
    preset_name: str, user_model: bool, model_vocab: int | None, data: Any
) -> tuple[str, int, int | None]:
    """(tokenizer, data.vocab_size, model.vocab_size) of a job."""
    tokenizer, data_vocab = data.tokenizer, data.vocab_size
    own_tokens = data.dataset is not None
    if own_tokens and tokenizer not in ("auto", "bytes"):
        raise ValueError(
            f"data.tokenizer = {tokenizer!r} applies to data.corpus; data.dataset yields its "
            "own token ids (leave data.tokenizer unset)"
        )
    preset = preset_vocab(preset_name)
    if tokenizer == "auto":
        tokenizer = "bpe" if preset > BYTE_VOCAB and not (user_model or own_tokens) else "bytes"
    if tokenizer == "bytes":
        if data_vocab not in (0, BYTE_VOCAB):
            raise ValueError(
                f"data.vocab_size = {data_vocab} sizes a trained BPE; byte-level tokens have "
                f"{BYTE_VOCAB} (leave it 0, or set data.tokenizer = 'bpe')"
            )
        if model_vocab is None and not user_model and preset != BYTE_VOCAB:
            model_vocab = BYTE_VOCAB
        return tokenizer, data_vocab, model_vocab
    if tokenizer == "bpe":
        if not data_vocab:
            data_vocab = model_vocab or (preset if preset > BYTE_VOCAB else BPE_VOCAB)
        if data_vocab < MIN_BPE_VOCAB:
            raise ValueError(
                f"data.vocab_size must be at least {MIN_BPE_VOCAB} for a BPE (the 256 byte "
                f"symbols and at least one merge), got {data_vocab}"
            )
        tokens = data_vocab
    else:
        path = Path(tokenizer).expanduser().absolute()
        tokenizer = str(path)
        tokens = tokenizer_file_vocab(path)
        if data_vocab not in (0, tokens):
            raise ValueError(
                f"data.vocab_size = {data_vocab} but {path} has {tokens} token ids "
                "(data.vocab_size sizes a trained BPE; leave it 0 with a tokenizer file)"
            )
        data_vocab = tokens
    if user_model:
        return tokenizer, data_vocab, model_vocab  # the user's model must cover `tokens` ids
    if model_vocab is None:
        model_vocab = tokens if tokenizer == "bpe" else _round_up(tokens, VOCAB_MULTIPLE)
    elif model_vocab < tokens:
        raise ValueError(
            f"model.vocab_size = {model_vocab} is smaller than the tokenizer's {tokens} token "
            "ids; raise it or leave it unset"
        )
    return tokenizer, data_vocab, model_vocab
