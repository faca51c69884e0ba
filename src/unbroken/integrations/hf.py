"""Hugging Face `transformers` causal LMs under unbroken: the model factory and the loss adapter.

`model.factory = "unbroken.integrations.hf:hf_causal_lm"` with the model's config in
`model.factory_args.config` (a table of `config.json` keys with its `model_type`, or the path of
a `config.json`) builds any causal LM `transformers.AutoModelForCausalLM` knows (Llama, Qwen2,
Mistral, ...) from that config, with fresh weights: nothing is downloaded. See
docs/own-model.md, "Hugging Face models", and `examples/hf-llama.toml`.

What the adapter settles, so a run is deterministic and recovers bit-exactly:

- **init** — the factory draws the weights from torch's global generator, which the trainer
  (`unbroken.engine.replica`) seeds from `train.seed` before calling it: every process builds
  the same model, and unbroken then moves it into flat storage.
- **vocabulary** — the factory takes `vocab_size`, so unbroken passes the job's (its tokenizer's,
  `unbroken.config.vocab`); it replaces the config's own.
- **dropout off** — every `*dropout` / `*_pdrop` probability of the config is set to 0.
- **attention** — `attn_implementation = "eager"` by default: the attention is plain matmul,
  mask add and softmax, the same kernels whatever the inputs, deterministic on CPU and GPU
  alike. ("sdpa" dispatches to one of several fused kernels by device, dtype and mask, whose
  GPU backward is not deterministic; choose it knowingly through `attn_implementation`.)
- **documents** — a packed `unbroken.data.MicroBatch` goes in as one row with its per-document
  `positions` as `position_ids`; with no attention mask and no cache, `transformers` reads the
  restarts of `position_ids` as document boundaries and masks attention block-diagonally causal,
  as the reference model does from `segment_ids` (checked in tests/ecosystem/test_hf_models.py).
- **loss** — the mean token cross-entropy over the micro-batch's targets, exactly the reference
  model's (fp32 logits, targets already shifted, IGNORE_INDEX across document ends).
- **pipeline stages** — `hf_causal_lm.pipeline` is an `HFPipeline`, the factory's stage source
  (the protocol of `unbroken.engine.own_stages`): its layer count from the config alone, and
  `unbroken.integrations.hf_stages.HFStageModel` cut from the full model, so a job with
  `parallel.pp > 1` trains it pipeline-parallel from the same initial weights as data-parallel.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from unbroken.errors import UserError
from unbroken.integrations.hf_stages import HFStageModel, check_pipeline_plan, token_cross_entropy

__all__ = [
    "ATTN_IMPLEMENTATION",
    "FACTORY",
    "INSTALL_HINT",
    "HFCausalLM",
    "HFPipeline",
    "hf_causal_lm",
    "hf_config",
    "token_cross_entropy",
]

FACTORY = "unbroken.integrations.hf:hf_causal_lm"
"""What `model.factory` names to train a Hugging Face causal LM."""

INSTALL_HINT = "pip install 'unbroken[hf]'"

ATTN_IMPLEMENTATION = "eager"
"""The default attention of the models built here (deterministic; see the module docstring)."""


def _transformers():
    """The `transformers` module, or a one-line UserError naming the extra to install."""
    try:
        import transformers
    except ImportError:
        raise UserError(
            f"model.factory {FACTORY!r} needs Hugging Face transformers: {INSTALL_HINT}"
        ) from None
    return transformers


def _read_config(path: str | Path) -> dict[str, Any]:
    file = Path(path).expanduser()
    if file.is_dir():
        file = file / "config.json"
    try:
        doc = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(
            f"model.factory_args.config: cannot read {file} as a config.json ({exc})"
        ) from None
    if not isinstance(doc, dict):
        raise UserError(f"model.factory_args.config: {file} holds no JSON object")
    return doc


def _dropout_off(config) -> None:
    for key, value in config.to_dict().items():
        if (key.endswith("dropout") or key.endswith("_pdrop")) and isinstance(value, float):
            setattr(config, key, 0.0)


def hf_config(config: Mapping[str, Any] | str | Path, vocab_size: int | None = None):
    """The `transformers` config of a causal LM, set up for training under unbroken.

    Args:
        config: `config.json` keys (with `model_type`, e.g. "llama", "qwen2"), or the path of a
            `config.json` (or of its folder).
        vocab_size: the job's vocabulary; replaces the config's when given.

    Returns:
        A `transformers.PretrainedConfig` with dropout off and no KV cache.

    Raises:
        UserError: transformers is missing, the file is unreadable, or the config names no
            model type transformers knows.
    """
    transformers = _transformers()
    keys = dict(_read_config(config) if isinstance(config, str | Path) else config)
    model_type = keys.pop("model_type", None)
    if not model_type:
        raise UserError('model.factory_args.config needs a model_type (e.g. model_type = "llama")')
    for key in ("architectures", "transformers_version", "auto_map"):
        keys.pop(key, None)
    if model_type not in transformers.CONFIG_MAPPING:
        raise UserError(
            f"model.factory_args.config: transformers {transformers.__version__} knows no "
            f"model_type {model_type!r} (causal LMs are e.g. 'llama', 'qwen2', 'mistral')"
        )
    hf = transformers.AutoConfig.for_model(model_type, **keys)
    if vocab_size is not None:
        hf.vocab_size = int(vocab_size)
    hf.use_cache = False
    _dropout_off(hf)
    return hf


class HFCausalLM(nn.Module):
    """A `transformers` causal LM behind unbroken's own-model forward: micro-batch in, mean
    loss out.

    Its parameters are the HF model's under the prefix ``hf.`` (``hf.model.embed_tokens.weight``;
    `train.no_decay` patterns name them so), and `.hf` is the HF model itself, e.g. for
    `.hf.save_pretrained(...)` after training.

    Args:
        hf: the `transformers` model (a `...ForCausalLM`).
    """

    def __init__(self, hf: nn.Module) -> None:
        super().__init__()
        self.hf = hf

    def forward(self, mb: Any) -> torch.Tensor:
        """Mean token loss of one micro-batch.

        Args:
            mb: a packed `unbroken.data.MicroBatch` (tokens, targets, positions), or a dict of
                HF model inputs with `labels` (unshifted, as HF takes them) from a user dataset.
        """
        device = next(self.hf.parameters()).device
        if isinstance(mb, Mapping):
            batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in mb.items()}
            if "labels" not in batch:
                raise UserError("a Hugging Face model's dict micro-batch needs 'labels'")
            return self.hf(**batch, use_cache=False).loss
        input_ids = mb.tokens.to(device, non_blocking=True).unsqueeze(0)
        position_ids = mb.positions.to(device, non_blocking=True).unsqueeze(0)
        targets = mb.targets.to(device, non_blocking=True)
        out = self.hf(input_ids=input_ids, position_ids=position_ids, use_cache=False)
        return token_cross_entropy(out.logits[0], targets)


def hf_causal_lm(
    config: Mapping[str, Any] | str,
    vocab_size: int | None = None,
    attn_implementation: str = ATTN_IMPLEMENTATION,
) -> HFCausalLM:
    """Build a Hugging Face causal LM from its config, with fresh weights (the model factory
    `model.factory = "unbroken.integrations.hf:hf_causal_lm"`).

    Weights are drawn from torch's global generator: unbroken seeds it from `train.seed` before
    it calls a factory, so every process (and every replacement after a failure) builds the
    same model.

    Args:
        config: `config.json` keys with `model_type`, or the path of a `config.json` (absolute,
            or relative to where `unbroken train` runs).
        vocab_size: the model's vocabulary; unbroken passes the job's (its tokenizer's).
        attn_implementation: "eager" (default, deterministic everywhere) or another
            `transformers` attention ("sdpa").

    Returns:
        The model behind unbroken's own-model forward (`HFCausalLM`), fp32.

    Raises:
        UserError: transformers is missing, or the config is not one of a causal LM.
    """
    transformers = _transformers()
    hf = hf_config(config, vocab_size)
    try:
        model = transformers.AutoModelForCausalLM.from_config(
            hf, attn_implementation=attn_implementation, dtype=torch.float32
        )
    except ValueError:
        raise UserError(
            f"model.factory_args.config: model_type {hf.model_type!r} is no causal LM that "
            "transformers.AutoModelForCausalLM builds (use e.g. 'llama', 'qwen2', 'mistral')"
        ) from None
    return HFCausalLM(model)


class HFPipeline:
    """The stage source of `hf_causal_lm` (`unbroken.engine.own_stages.StageSource`): what the
    plan engine asks a factory to train its model pipeline-parallel. Models whose config
    declares the `embed_tokens -> layers -> norm` pipeline plan split (Llama, Qwen2, Mistral);
    others (GPT-2) are refused from their config."""

    def num_layers(
        self,
        config: Mapping[str, Any] | str,
        vocab_size: int | None = None,
        attn_implementation: str = ATTN_IMPLEMENTATION,
    ) -> int:
        """The model's decoder layers, from the factory's arguments (no model is built).

        Raises:
            UserError: the config is unreadable or names no model type transformers knows.
            ValueError: the model does not split into pipeline stages.
        """
        hf = hf_config(config, vocab_size)
        check_pipeline_plan(hf)
        return int(hf.num_hidden_layers)

    def stage(self, model: nn.Module, layer_ranges: Sequence[tuple[int, int]]) -> HFStageModel:
        """The part of `model` (an `HFCausalLM` the factory built) that runs `layer_ranges`.

        Raises:
            ValueError: the model does not split, or a range lies outside its layers.
        """
        return HFStageModel(model, layer_ranges)


hf_causal_lm.pipeline = HFPipeline()  # type: ignore[attr-defined]
"""The factory's stage source (`unbroken.engine.own_stages`)."""
