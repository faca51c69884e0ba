"""Reference model size presets: their shapes and the vocabulary each one is trained with.

This is configuration data, so it lives with the configs: `JobConfig` reads a preset's
vocabulary to pick the job's default tokenizer (`unbroken.config.vocab`) and
`unbroken.model.resolve_args` turns a preset into `TransformerArgs`. It imports nothing.

The tiny and small presets (CI, the demo) are byte-level: vocabulary `BYTE_VOCAB`, no
tokenizer to train, so every demo and test hash is independent of the `tokenizers` library. The
125m, 350m and 1b presets carry a `BPE_VOCAB` vocabulary and train with a byte-level BPE fitted
on the job's corpus (`unbroken.data.tokenizer`); their names count the parameters with it.
"""

from __future__ import annotations

__all__ = ["BPE_VOCAB", "BYTE_VOCAB", "PRESETS", "preset_vocab"]

BYTE_VOCAB = 256
"""Vocabulary of byte-level tokens: one id per byte value."""

BPE_VOCAB = 32768
"""Vocabulary of the BPE presets: a power of two, so it splits evenly over any tensor-parallel
degree, and the order of Llama's (32000)."""

# name -> TransformerArgs fields. Parameter counts are for the dense variant.
PRESETS: dict[str, dict[str, int]] = {
    # ~0.1M params, byte-level: unit tests and CI.
    "tiny": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=176),
    # ~0.8M params, byte-level: the demo on 4 CPU ranks.
    "small": dict(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=352),
    # ~126M params (76M without the embedding and output head).
    "125m": dict(
        dim=768, n_layers=12, n_heads=12, n_kv_heads=4, ffn_dim=2048, vocab_size=BPE_VOCAB
    ),
    # ~350M params.
    "350m": dict(
        dim=1024, n_layers=24, n_heads=16, n_kv_heads=8, ffn_dim=2816, vocab_size=BPE_VOCAB
    ),
    # ~1.08B params.
    "1b": dict(dim=2048, n_layers=20, n_heads=16, n_kv_heads=8, ffn_dim=5632, vocab_size=BPE_VOCAB),
}


def preset_vocab(preset: str) -> int:
    """The vocabulary a preset is built with (`BYTE_VOCAB` unless it names its own; an unknown
    preset counts as byte-level here and is rejected by `resolve_args`)."""
    return PRESETS.get(preset, {}).get("vocab_size", BYTE_VOCAB)
