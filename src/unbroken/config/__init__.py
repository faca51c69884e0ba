"""Typed, validated job configuration loaded from TOML.

Each component owns a small `@dataclass(kw_only=True, slots=True) class ...Config` with a
docstring on every field (see the component's module). `JobConfig` only nests them. Loading
rejects unknown keys and wrong types with one line that names the key and the file, and every
config validates its invariants at construction (`__post_init__`). What the Python API accepts
in place of config keys is turned into them here too: Python objects into `model.factory` /
`data.dataset` references (`config.objects`), AdamW settings into `train.*`
(`config.optimizer`).
"""

from unbroken.config.job import (
    AdaptConfig,
    CheckpointConfig,
    DataConfig,
    JobConfig,
    MetricsConfig,
    ModelConfig,
    ParallelConfig,
    ProtectionConfig,
    RecoveryConfig,
    TrainConfig,
)
from unbroken.config.loader import config_from_dict, load_config, to_dict
from unbroken.config.nodes import NodesConfig

__all__ = [
    "AdaptConfig",
    "CheckpointConfig",
    "DataConfig",
    "JobConfig",
    "MetricsConfig",
    "ModelConfig",
    "NodesConfig",
    "ParallelConfig",
    "ProtectionConfig",
    "RecoveryConfig",
    "TrainConfig",
    "config_from_dict",
    "load_config",
    "to_dict",
]
