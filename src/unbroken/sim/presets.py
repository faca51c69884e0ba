"""Named hardware and model presets shipped as TOML under `unbroken/sim/presets/`.

Owns lookup by name and the "preset + overrides" rule used by cluster configs: a table with a
`preset` key starts from that preset's values and replaces the keys it lists. Presets are data;
this module never edits them.
"""

from __future__ import annotations

from importlib import resources
from typing import Any

from unbroken.errors import UserError
from unbroken.sim._load import build
from unbroken.sim.hardware import HardwareConfig
from unbroken.sim.workload import ModelConfig, ParallelConfig

__all__ = [
    "hardware_names",
    "load_hardware",
    "load_model",
    "model_names",
    "preset_table",
    "testbed_hardware",
]


def preset_table(filename: str) -> dict[str, Any]:
    """The parsed preset file `filename` (e.g. "models.toml")."""
    import tomllib

    text = resources.files("unbroken.sim").joinpath("presets").joinpath(filename).read_text()
    return tomllib.loads(text)


def hardware_names() -> list[str]:
    """Names of the hardware presets."""
    return sorted(preset_table("hardware.toml"))


def model_names() -> list[str]:
    """Names of the model presets."""
    return sorted(preset_table("models.toml"))


def _merge(preset: dict[str, Any] | None, overrides: dict[str, Any]) -> dict[str, Any]:
    merged = dict(preset or {})
    merged.update({k: v for k, v in overrides.items() if k != "preset"})
    return merged


def load_hardware(spec: str | dict[str, Any], where: str = "hardware") -> HardwareConfig:
    """A `HardwareConfig` from a preset name or a table (optionally with `preset = NAME`).

    Raises:
        UserError: unknown preset name, unknown key or invalid value.
    """
    table = {"preset": spec} if isinstance(spec, str) else dict(spec)
    base = None
    if "preset" in table:
        presets = preset_table("hardware.toml")
        name = table["preset"]
        if name not in presets:
            raise UserError(
                f"{where}: unknown hardware preset {name!r} (known: {', '.join(sorted(presets))})"
            )
        base = presets[name]
    return build(HardwareConfig, _merge(base, table), where)


def load_model(
    spec: str | dict[str, Any],
    parallel: dict[str, Any] | None = None,
    where: str = "model",
) -> tuple[ModelConfig, ParallelConfig]:
    """A model and its parallel layout from a preset name or tables.

    Args:
        spec: a model preset name, or a table of `ModelConfig` keys (optionally `preset = NAME`).
        parallel: `ParallelConfig` keys overriding the preset's layout (or all of them).
        where: file/table name for error messages.

    Raises:
        UserError: unknown preset, unknown key or invalid value.
    """
    table = {"preset": spec} if isinstance(spec, str) else dict(spec)
    base_model: dict[str, Any] | None = None
    base_par: dict[str, Any] = {}
    if "preset" in table:
        presets = preset_table("models.toml")
        name = table["preset"]
        if name not in presets:
            raise UserError(
                f"{where}: unknown model preset {name!r} (known: {', '.join(sorted(presets))})"
            )
        base_model = {k: v for k, v in presets[name].items() if k not in ("parallel", "testbed")}
        base_model["name"] = name
        base_par = presets[name].get("parallel", {})
    model = build(ModelConfig, _merge(base_model, table), where)
    par_table = _merge(base_par, parallel or {})
    return model, build(ParallelConfig, par_table, f"{where}.parallel")


def testbed_hardware(model_name: str) -> str | None:
    """The hardware preset a Table 2 model ran on in the paper, if any."""
    entry = preset_table("models.toml").get(model_name, {})
    return entry.get("testbed", {}).get("hardware")
