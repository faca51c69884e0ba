"""Model size presets, from a CI-tiny model to ~1B parameters (byte-level vocabulary)."""

from __future__ import annotations

__all__ = ["PRESETS"]

# name -> TransformerArgs fields. Parameter counts are for the dense variant.
PRESETS: dict[str, dict[str, int]] = {
    # ~0.1M params: unit tests and CI.
    "tiny": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=176),
    # ~0.8M params: the demo on 4 CPU ranks.
    "small": dict(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=352),
    # ~76M params (byte-level vocabulary keeps the embedding small).
    "125m": dict(dim=768, n_layers=12, n_heads=12, n_kv_heads=4, ffn_dim=2048),
    # ~284M params.
    "350m": dict(dim=1024, n_layers=24, n_heads=16, n_kv_heads=8, ffn_dim=2816),
    # ~0.94B params.
    "1b": dict(dim=2048, n_layers=20, n_heads=16, n_kv_heads=8, ffn_dim=5632),
}
