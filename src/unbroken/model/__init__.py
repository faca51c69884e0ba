"""Reference models built to be sharded and to live in caller-provided flat storage.

`build_model` constructs a Llama-style decoder (dense or MoE) on the meta device; `FlatLayout`
assigns every parameter a fixed offset in one flat fp32 buffer and `materialize` turns the
parameters into views of storage the caller owns (later: the state manager's retained memory).
"""

from unbroken.model.flat import FlatLayout, ParamSlot, init_parameters, materialize
from unbroken.model.llama import (
    TIED_EMBEDDINGS,
    Transformer,
    TransformerArgs,
    build_model,
    compile_blocks,
    resolve_args,
)
from unbroken.model.presets import PRESETS

__all__ = [
    "PRESETS",
    "TIED_EMBEDDINGS",
    "FlatLayout",
    "ParamSlot",
    "Transformer",
    "TransformerArgs",
    "build_model",
    "compile_blocks",
    "init_parameters",
    "materialize",
    "resolve_args",
]
