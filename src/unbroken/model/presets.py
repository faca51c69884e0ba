"""Model size presets, from a CI-tiny model to ~1B parameters: re-exported from
`unbroken.config.presets`, which owns them (the job config picks its default tokenizer from a
preset's vocabulary, and the config layer imports nothing above it)."""

from __future__ import annotations

from unbroken.config.presets import BPE_VOCAB, BYTE_VOCAB, PRESETS, preset_vocab

__all__ = ["BPE_VOCAB", "BYTE_VOCAB", "PRESETS", "preset_vocab"]
