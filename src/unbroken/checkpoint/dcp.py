"""Save, verify and load checkpoints of the flat training state with DCP.

Layout: ROOT/iter_00000012/ holds DCP's files for the state *before* iteration 12 runs, plus
`manifest.json` = {"iteration", "files": {name: sha256}}, written by rank 0 after every rank
has finished saving (a barrier), via a temporary file and rename. Without a manifest, or with a
file whose hash differs, the checkpoint is invalid.

Saved: the flat parameters and optimizer moments, the next iteration (which is also the data
position: the sampler is pure) and `rng_seed`, the seed that with the iteration determines
every random draw of the model (`unbroken.train.rng`); loading into a job with another seed is
refused, since it would silently continue with other data and other dropout masks.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from unbroken.train.state import TrainState

__all__ = [
    "CheckpointInfo",
    "CheckpointMismatch",
    "checkpoint_path",
    "find_latest_valid",
    "list_checkpoints",
    "load_checkpoint",
    "save_checkpoint",
    "verify_checkpoint",
]

MANIFEST = "manifest.json"


@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    path: Path
    iteration: int
    """The next iteration to run after loading."""


def checkpoint_path(root: Path, iteration: int) -> Path:
    """The directory of the checkpoint of the state before `iteration`."""
    return root / f"iter_{iteration:08d}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _state_dict(
    state: TrainState, iteration: int, shard: str = "", rng_seed: int = 0
) -> dict[str, torch.Tensor]:
    """`shard`: a per-rank key prefix for states that differ between ranks (pipeline stages, TP
    shards); without it DCP treats equal keys as one replicated tensor and saves it once."""
    sd = {f"{shard}/{k}" if shard else k: v for k, v in state.persistent().items()}
    sd["iteration"] = torch.tensor(iteration, dtype=torch.int64)
    sd["rng_seed"] = torch.tensor(rng_seed, dtype=torch.int64)
    return sd


class CheckpointMismatch(RuntimeError):
    """The checkpoint belongs to a job with another seed."""


def save_checkpoint(
    root: str | Path,
    state: TrainState,
    iteration: int,
    *,
    group: dist.ProcessGroup | None,
    rank: int,
    keep: int,
    shard: str = "",
    rng_seed: int = 0,
) -> float:
    """Save the state before `iteration` runs; returns the seconds it took (all ranks).

    Every rank calls this; rank 0 writes the manifest and prunes old checkpoints.
    """
    t0 = time.perf_counter()
    root = Path(root)
    path = checkpoint_path(root, iteration)
    if rank == 0 and path.exists():
        shutil.rmtree(path)  # a torn save of the same iteration from an earlier generation
    if group is not None:
        dist.barrier(group=group)
    sd = {
        k: v.detach().cpu() if v.device.type != "cpu" else v
        for k, v in _state_dict(state, iteration, shard, rng_seed).items()
    }
    dcp.save(sd, checkpoint_id=str(path), process_group=group)
    if group is not None:
        dist.barrier(group=group)
    if rank == 0:
        files = {p.name: _sha256(p) for p in sorted(path.iterdir()) if p.name != MANIFEST}
        tmp = path / f".{MANIFEST}.tmp"
        tmp.write_text(json.dumps({"iteration": iteration, "files": files}, indent=1))
        os.replace(tmp, path / MANIFEST)
        _prune(root, keep)
    if group is not None:
        dist.barrier(group=group)
    return time.perf_counter() - t0


def _prune(root: Path, keep: int) -> None:
    valid = [c for c in list_checkpoints(root) if (c.path / MANIFEST).exists()]
    for old in valid[:-keep]:
        shutil.rmtree(old.path, ignore_errors=True)


def list_checkpoints(root: str | Path) -> list[CheckpointInfo]:
    """Checkpoint directories under root, oldest first (valid or not)."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        if p.is_dir() and p.name.startswith("iter_"):
            try:
                out.append(CheckpointInfo(p, int(p.name[5:])))
            except ValueError:
                continue
    return sorted(out, key=lambda c: c.iteration)


def verify_checkpoint(info: CheckpointInfo) -> str | None:
    """None when complete and intact, else the reason it is not."""
    manifest = info.path / MANIFEST
    if not manifest.exists():
        return "incomplete (no manifest)"
    try:
        meta = json.loads(manifest.read_text())
        files = meta["files"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return "corrupt manifest"
    if meta.get("iteration") != info.iteration:
        return "manifest names another iteration"
    for name, digest in files.items():
        f = info.path / name
        if not f.exists():
            return f"missing file {name}"
        if _sha256(f) != digest:
            return f"checksum mismatch in {name}"
    return None


def find_latest_valid(root: str | Path, on_skip=None) -> CheckpointInfo | None:
    """The newest complete, intact checkpoint; `on_skip(info, reason)` hears about the others."""
    for info in reversed(list_checkpoints(root)):
        reason = verify_checkpoint(info)
        if reason is None:
            return info
        if on_skip is not None:
            on_skip(info, reason)
    return None


def load_checkpoint(
    info: CheckpointInfo,
    state: TrainState,
    *,
    group: dist.ProcessGroup | None,
    shard: str = "",
    rng_seed: int | None = None,
) -> int:
    """Load into the flat buffers in place; returns the next iteration to run.

    Raises:
        CheckpointMismatch: `rng_seed` is given and the checkpoint was saved with another.
    """
    sd = _state_dict(state, 0, shard)
    host = {k: (v.cpu() if v.device.type != "cpu" else v) for k, v in sd.items()}
    dcp.load(host, checkpoint_id=str(info.path), process_group=group)
    saved = int(host.pop("rng_seed"))
    sd.pop("rng_seed")
    if rng_seed is not None and saved != rng_seed:
        raise CheckpointMismatch(
            f"{info.path}: saved by a job with train.seed = {saved}, this job has {rng_seed}"
        )
    for k, v in sd.items():
        if v.data_ptr() != host[k].data_ptr():
            v.copy_(host[k])
    return int(host["iteration"])
