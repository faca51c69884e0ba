"""The coordinator's side of a replayed plan change ([Note: replayed plan change] in
`unbroken.launch.coordinator.adapt_plan`): the checkpoint a generation that changes the job's
bits starts from, kept beside the run for the reference's replay (`ReplayPoint`: also where
a replaying reference run starts, `Coordinator(start=...)`).

The kept checkpoint is a tree of hard links (a copy where the file system refuses links): the
run's checkpoint policy deletes old checkpoints as it saves new ones (`checkpoint.keep`), and
the reference replays after the run. A link shares the sealed files, whose size and stamp the
reader's quick check proves unchanged ([Note: checkpoint seal] in `unbroken.checkpoint.dcp`);
a file rewritten after it was kept fails that check, is hashed again, and the replay finds no
valid checkpoint — the audit then fails, it does not pass on other bits.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from unbroken.checkpoint.dcp import find_latest_valid

__all__ = ["ReplayPoint", "keep_newest_checkpoint", "replay_points"]


@dataclass(frozen=True, slots=True)
class ReplayPoint:
    """A plan change the reference replays (the `replay_point` event's fields): the
    generation that runs `plan` (`ParallelPlan.to_dict`, ranks 0..world-1) on `world` ranks
    from iteration `iteration`, loaded from the checkpoint kept under `checkpoint_dir` (None:
    no checkpoint existed, it starts from the initial state)."""

    generation: int
    iteration: int
    plan: dict[str, Any]
    world: int
    checkpoint_dir: str | None

    def to_event(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_event(cls, e: dict[str, Any]) -> ReplayPoint:
        return cls(**{k: e[k] for k in cls.__slots__})


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def keep_newest_checkpoint(root: Path, dest: Path) -> int:
    """Keep the newest valid checkpoint under `root` in `dest` (linked, `dest/iter_N`), the
    one a generation about to start from the checkpoint loads: nothing saves between the
    stopped generation and its load. Returns its iteration (0 and nothing kept: none)."""
    info = find_latest_valid(root)
    if info is None:
        return 0
    target = dest / info.path.name
    shutil.rmtree(target, ignore_errors=True)
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copytree(info.path, target, copy_function=_link_or_copy)
    return info.iteration


def replay_points(events: list[dict[str, Any]], run: str | None = None) -> list[ReplayPoint]:
    """A run's replayed plan changes, in order (`run`: only that run's events)."""
    return [
        ReplayPoint.from_event(e)
        for e in events
        if e["kind"] == "replay_point" and (run is None or e.get("run") == run)
    ]
