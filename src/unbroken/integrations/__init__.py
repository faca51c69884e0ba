"""Adapters that let models of other libraries train under unbroken through the own-model
contract (docs/own-model.md): `unbroken.integrations.hf` for Hugging Face `transformers` causal
LMs. Each adapter imports its library only when used, so unbroken runs without it; nothing here
is imported by the rest of unbroken (a job names an adapter in `model.factory`).
"""

__all__: list[str] = []
