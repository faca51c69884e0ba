"""Periodic checkpoints with torch.distributed.checkpoint (DCP) and their interval.

The baseline recovery (checkpoint-restart) and the fallback for fatal failures. A checkpoint
directory is complete only when its manifest (sha256 of every file, written last, atomically)
exists and matches; a corrupt or incomplete one is skipped and the previous one is used.
"""

from unbroken.checkpoint.dcp import (
    CheckpointInfo,
    CheckpointMismatch,
    CheckpointStager,
    PendingSave,
    check_seed,
    checkpoint_root,
    find_latest_valid,
    list_checkpoints,
    load_checkpoint,
    read_layout,
    save_checkpoint,
    save_checkpoint_async,
    verify_checkpoint,
)
from unbroken.checkpoint.interval import young_interval

__all__ = [
    "CheckpointInfo",
    "CheckpointMismatch",
    "CheckpointStager",
    "PendingSave",
    "check_seed",
    "checkpoint_root",
    "find_latest_valid",
    "list_checkpoints",
    "load_checkpoint",
    "read_layout",
    "save_checkpoint",
    "save_checkpoint_async",
    "verify_checkpoint",
    "young_interval",
]
