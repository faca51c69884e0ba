"""Save, verify and load checkpoints of the flat training state with DCP.

Layout: ROOT/iter_00000012/ holds DCP's files for the state *before* iteration 12 runs, plus
`manifest.json` = {"iteration", "files": {name: sha256}, "sizes", "stamps"}, written by rank 0
after every rank has finished saving, via a temporary file and rename. Without a manifest, or
with a file whose contents differ from what was saved, the checkpoint is invalid.

[Note: checkpoint seal] The sha256 of every file is computed once, at save. The saver then
stamps each file's modification time with a value from before the save began and records it
with the file's size: a quick check (size and stamp, like rsync's) then proves on resume that
nothing rewrote the file since its digest was taken, without reading it again — any later write
sets the modification time to the present. A file that fails the quick check (or a manifest
without stamps) is hashed again and must match its digest.

Saved: the flat parameters and optimizer moments, the next iteration (which is also the data
position: the sampler is pure) and `rng_seed`, the seed that with the iteration determines
every random draw of the model (`unbroken.train.rng`); loading into a job with another seed is
refused, since it would silently continue with other data and other dropout masks.

`layout.json` (when the saver gives one) names the parallel layout the flat buffers were
saved under — which rank holds which layers and which tensor-parallel shard — so a job under
another plan can load them (`unbroken.engine.ckpt_layout`); rank 0 writes it before the seal,
which digests it with the rest.

Two ways to save: `save_checkpoint` blocks until the checkpoint is complete;
`save_checkpoint_async` blocks only while the state is copied into pinned host memory
(`CheckpointStager`) and returns a `PendingSave` whose files, digests and manifest are written
by a background thread — the caller waits on it before the next save and before exiting.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from unbroken.train.state import TrainState

__all__ = [
    "CheckpointInfo",
    "CheckpointMismatch",
    "CheckpointStager",
    "PendingSave",
    "check_seed",
    "checkpoint_path",
    "checkpoint_root",
    "find_latest_valid",
    "list_checkpoints",
    "load_checkpoint",
    "read_layout",
    "save_checkpoint",
    "save_checkpoint_async",
    "verify_checkpoint",
]

MANIFEST = "manifest.json"
LAYOUT = "layout.json"
_WRITE_THREADS = 8
"""Files DCP writes per rank in parallel (and the digests computed in parallel)."""
_STAMP_AGE_NS = 1_000_000_000
"""The seal's stamp lies this far before the save began (see [Note: checkpoint seal])."""


@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    path: Path
    iteration: int
    """The next iteration to run after loading."""


def checkpoint_root(directory: str, run_dir: str | Path, run_name: str) -> Path:
    """Where a run's checkpoints live: `checkpoint.dir` (`directory`) when set, else
    RUN_DIR/checkpoints/RUN (the trainers save and load there; the coordinator keeps one
    from there for a replayed plan change)."""
    return Path(directory or Path(run_dir) / "checkpoints" / run_name)


def checkpoint_path(root: Path, iteration: int) -> Path:
    """The directory of the checkpoint of the state before `iteration`."""
    return root / f"iter_{iteration:08d}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(1 << 24):
            h.update(chunk)  # hashlib releases the GIL: files hash in parallel
    return h.hexdigest()


def _digests(paths: list[Path]) -> dict[str, str]:
    with ThreadPoolExecutor(max_workers=max(1, min(len(paths), _WRITE_THREADS))) as pool:
        return dict(zip((p.name for p in paths), pool.map(_sha256, paths), strict=True))


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


def _seal(path: Path, iteration: int, stamp_ns: int, layout: str = "") -> None:
    """Rank 0, after every rank's files are complete: the layout record, then digest, stamp
    and record every file, then publish the manifest atomically (see [Note: checkpoint
    seal])."""
    if layout:
        (path / LAYOUT).write_text(layout)
    files = sorted(p for p in path.iterdir() if p.is_file() and not p.name.startswith("."))
    files = [p for p in files if p.name != MANIFEST]
    digests = _digests(files)
    for f in files:
        os.utime(f, ns=(stamp_ns, stamp_ns))
    meta = {
        "iteration": iteration,
        "files": digests,
        "sizes": {f.name: f.stat().st_size for f in files},
        "stamps": {f.name: f.stat().st_mtime_ns for f in files},
    }
    tmp = path / f".{MANIFEST}.tmp"
    with tmp.open("w") as fh:
        json.dump(meta, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path / MANIFEST)


def _writer(path: Path) -> dcp.FileSystemWriter:
    return dcp.FileSystemWriter(path, thread_count=_WRITE_THREADS)


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
    layout: str = "",
) -> float:
    """Save the state before `iteration` runs; returns the seconds it took (all ranks).

    Every rank calls this; rank 0 writes the layout record (`layout`, if any) and the
    manifest, and prunes old checkpoints.
    """
    t0 = time.perf_counter()
    stamp = time.time_ns() - _STAMP_AGE_NS
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
    dcp.save(sd, storage_writer=_writer(path), process_group=group)
    if group is not None:
        dist.barrier(group=group)
    if rank == 0:
        _seal(path, iteration, stamp, layout)
        _prune(root, keep)
    if group is not None:
        dist.barrier(group=group)
    return time.perf_counter() - t0


class CheckpointStager:
    """Host copies of the state for asynchronous saves: pinned buffers (for a GPU state),
    allocated once and reused, so a save blocks the training loop only for one device-to-host
    copy at PCIe speed. One save at a time uses them: staging waits for the previous save."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._pending: PendingSave | None = None
        self._groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
        """The gloo groups of the background writes, by ranks (see `_checkpoint_group`)."""

    def wait(self) -> float | None:
        """Wait for the save in flight, if any; its seconds from start to completion.

        Raises:
            RuntimeError: it failed (the checkpoint stays invalid).
        """
        pending, self._pending = self._pending, None
        return pending.wait() if pending is not None else None

    def reserve(self, state: TrainState, shard: str = "") -> None:
        """Allocate the buffers ahead of the first save (pinning many GiB takes seconds)."""
        for k, v in _state_dict(state, 0, shard).items():
            self._buffer(k, v)

    def _buffer(self, key: str, like: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get(key)
        if buf is None or buf.shape != like.shape or buf.dtype != like.dtype:
            pin = like.device.type == "cuda"
            buf = torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=pin)
            self._buffers[key] = buf
        return buf

    def stage(self, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Copy `sd` into the host buffers; returns when the copies are complete."""
        if self._pending is not None:
            self._pending.wait()
        out = {k: self._buffer(k, v) for k, v in sd.items()}
        cuda = [v.device for v in sd.values() if v.device.type == "cuda"]
        if not cuda:
            for k, v in sd.items():
                out[k].copy_(v)
            return out
        side = torch.cuda.Stream(cuda[0])
        side.wait_stream(torch.cuda.current_stream(cuda[0]))
        with torch.cuda.stream(side):
            for k, v in sd.items():
                out[k].copy_(v, non_blocking=v.device.type == "cuda")
        side.synchronize()
        return out


@dataclass(slots=True)
class PendingSave:
    """A checkpoint being written in the background (`save_checkpoint_async`)."""

    path: Path
    iteration: int
    blocking_s: float
    """Seconds the caller was blocked (waiting for an earlier save, staging)."""
    _thread: threading.Thread | None = None
    _error: list[BaseException] = field(default_factory=list)
    _total_s: list[float] = field(default_factory=list)

    def done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> float:
        """Block until the checkpoint is complete (rank 0: sealed and published); returns the
        seconds from the start of the save to its completion.

        Raises:
            RuntimeError: the background save failed (the checkpoint stays invalid).
        """
        if self._thread is not None:
            self._thread.join()
        if self._error:
            raise RuntimeError(f"checkpoint {self.path} failed: {self._error[0]!r}")
        return self._total_s[0] if self._total_s else self.blocking_s


def _checkpoint_group(
    group: dist.ProcessGroup | None, stager: CheckpointStager
) -> dist.ProcessGroup | None:
    """The process group the background thread's DCP collectives use: none for one rank;
    else a gloo group of the same ranks, made once per stager (every rank makes it at its
    first async save), so that they never interleave with the training loop's collectives on
    `group`."""
    if group is None or dist.get_world_size(group) == 1:
        return None
    ranks = tuple(dist.get_process_group_ranks(group))
    if ranks not in stager._groups:
        stager._groups[ranks] = dist.new_group(list(ranks), backend="gloo")
    return stager._groups[ranks]


def save_checkpoint_async(
    root: str | Path,
    state: TrainState,
    iteration: int,
    *,
    group: dist.ProcessGroup | None,
    rank: int,
    keep: int,
    shard: str = "",
    rng_seed: int = 0,
    stager: CheckpointStager,
    layout: str = "",
) -> PendingSave:
    """Start saving the state before `iteration`: blocks while the state is staged into
    `stager`'s host buffers, then writes, digests, seals and prunes in a background thread.

    Every rank calls this at the same point; the caller must `wait()` on the result before
    it exits (an earlier save still running is waited for here, before staging). The state
    may change as soon as this returns.
    """
    t0 = time.perf_counter()
    stamp = time.time_ns() - _STAMP_AGE_NS
    root = Path(root)
    path = checkpoint_path(root, iteration)
    if stager._pending is not None:
        stager._pending.wait()
    ckpt_group = _checkpoint_group(group, stager)
    if rank == 0 and path.exists():
        shutil.rmtree(path)  # a torn save of the same iteration from an earlier generation
    if group is not None:
        dist.barrier(group=group)
    staged = stager.stage(_state_dict(state, iteration, shard, rng_seed))
    pending = PendingSave(path, iteration, time.perf_counter() - t0)

    def write() -> None:
        try:
            dcp.save(
                staged,
                storage_writer=_writer(path),
                process_group=ckpt_group,
                no_dist=ckpt_group is None,
            )
            # DCP's last step gathers every rank's write results at rank 0 before it writes
            # the metadata: when it returns there, every rank's files are complete.
            if rank == 0:
                _seal(path, iteration, stamp, layout)
                _prune(root, keep)
        except BaseException as exc:  # re-raised by wait()
            pending._error.append(exc)
        pending._total_s.append(time.perf_counter() - t0)

    pending._thread = threading.Thread(target=write, name=f"checkpoint-{iteration}")
    pending._thread.start()
    stager._pending = pending
    return pending


def check_seed(info: CheckpointInfo, saved: int, rng_seed: int) -> None:
    """Refuse a checkpoint saved with another `train.seed` than the job's.

    Raises:
        CheckpointMismatch: the seeds differ.
    """
    if saved != rng_seed:
        raise CheckpointMismatch(
            f"{info.path}: saved by a job with train.seed = {saved}, this job has {rng_seed}"
        )


def read_layout(info: CheckpointInfo) -> str | None:
    """The layout record the checkpoint was saved with; None when it has none (saved before
    layouts were recorded, or by a caller that gave none)."""
    f = info.path / LAYOUT
    return f.read_text() if f.exists() else None


def _prune(root: Path, keep: int) -> None:
    """Keep the newest `keep` sealed checkpoints, and remove every torn save (no manifest)
    older than the newest sealed one: a save cut by a crash that no later generation redid —
    nothing resumes a save of an iteration a sealed checkpoint has passed. (A 30-kill campaign
    of asynchronous 125m saves, most kills at a save, left 52 GB in its run directories on the
    H200 machine's 64 GB disk at stop 48; such torn saves are the likely bulk of it.)"""
    every = list_checkpoints(root)
    valid = [c for c in every if (c.path / MANIFEST).exists()]
    torn = [c for c in every if valid and c.iteration < valid[-1].iteration and c not in valid]
    for old in valid[:-keep] + torn:
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


def verify_checkpoint(info: CheckpointInfo, *, contents: bool = False) -> str | None:
    """None when complete and intact, else the reason it is not.

    Args:
        contents: hash every file even where the quick check (size and stamp, see
            [Note: checkpoint seal]) passes.
    """
    manifest = info.path / MANIFEST
    if not manifest.exists():
        return "incomplete (no manifest)"
    try:
        meta = json.loads(manifest.read_text())
        files = meta["files"]
        sizes = meta.get("sizes", {})
        stamps = meta.get("stamps", {})
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
        return "corrupt manifest"
    if meta.get("iteration") != info.iteration:
        return "manifest names another iteration"
    for name, digest in files.items():
        f = info.path / name
        try:
            st = f.stat()
        except FileNotFoundError:
            return f"missing file {name}"
        if name in sizes and st.st_size != sizes[name]:
            return f"size mismatch in {name}"
        sealed = name in stamps and st.st_mtime_ns == stamps[name]
        if (contents or not sealed) and _sha256(f) != digest:
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
    stager: CheckpointStager | None = None,
) -> int:
    """Load into the flat buffers in place; returns the next iteration to run.

    Without a process group (or with one rank) the tensors are read by parallel DCP loads,
    one per tensor. Device tensors load through host buffers — `stager`'s pinned ones when
    given (then copied to the device asynchronously), else fresh ones; nothing is copied out
    of the device first.

    Raises:
        CheckpointMismatch: `rng_seed` is given and the checkpoint was saved with another.
    """
    sd = _state_dict(state, 0, shard)
    if stager is not None and stager._pending is not None:
        stager._pending.wait()  # its buffers may still be written out

    def host_buffer(k: str, v: torch.Tensor) -> torch.Tensor:
        if v.device.type == "cpu":
            return v
        return stager._buffer(k, v) if stager is not None else torch.empty_like(v, device="cpu")

    host = {k: host_buffer(k, v) for k, v in sd.items()}
    if group is None or dist.get_world_size(group) == 1:
        with ThreadPoolExecutor(max_workers=len(host)) as pool:
            done = pool.map(
                lambda item: dcp.load(dict([item]), checkpoint_id=str(info.path), no_dist=True),
                host.items(),
            )
            list(done)
    else:
        dcp.load(host, checkpoint_id=str(info.path), process_group=group)
    saved = int(host.pop("rng_seed"))
    sd.pop("rng_seed")
    if rng_seed is not None:
        check_seed(info, saved, rng_seed)
    for k, v in sd.items():
        if v.data_ptr() != host[k].data_ptr():
            v.copy_(host[k], non_blocking=host[k].is_pinned())
    if any(v.is_cuda for v in sd.values()):
        torch.cuda.synchronize()
    return int(host["iteration"])
