"""The reference a re-planned run is audited against when a plan change changed its bits
([Note: replayed plan change] in `unbroken.launch.coordinator.adapt_plan`): the fault-free
reference on the launch plan for the generations before the change, then each replay of the
fault-free reference from the change's checkpoint under the new plan (`unbroken.api`) for the
generations from it up to the next change."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["reference_rows", "replay_records", "replayed_reference"]


def replayed_reference(
    reference: dict[str, Any], replays: list[tuple[Any, dict[str, Any]]]
) -> dict[str, Any]:
    """`reference` (a run outcome's dict) with each replay's rows as a segment
    (`"segments"`: [{"generation", "rows"}], `replays`: (`ReplayPoint`, the replaying run's
    outcome dict), in the faulty run's order) and the last replay's final hashes. No replays:
    `reference`."""
    if not replays:
        return reference
    last = replays[-1][1]
    return {
        **reference,
        "segments": [
            {"generation": point.generation, "rows": run["metrics"]} for point, run in replays
        ],
        "final_state_hash": last["final_state_hash"],
        "rank_hashes": last.get("rank_hashes"),
    }


def reference_rows(reference: dict[str, Any]) -> Callable[[int, int], dict[str, Any] | None]:
    """`(generation, iteration) -> the reference row` a faulty run's row of that generation
    is audited against: the launch-plan reference's before the first replayed change's
    generation, else the last replay begun at or before it (a row of a generation that ran
    before a change, an iteration the change then ran again, is the launch plan's)."""
    base = {m["iter"]: m for m in reference["metrics"]}
    segments = [
        (seg["generation"], {m["iter"]: m for m in seg["rows"]})
        for seg in reference.get("segments", ())
    ]

    def row(generation: int, iteration: int) -> dict[str, Any] | None:
        rows = base
        for first, seg in segments:
            if generation >= first:
                rows = seg
        return rows.get(iteration)

    return row


def replay_records(replays: list[tuple[Any, dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per replayed change for `summary.json`: where it took effect, the plan's shape,
    the replay's run and final hash."""
    out = []
    for point, run in replays:
        groups = [g for rep in point.plan["replicas"] for g in rep]
        out.append(
            {
                "generation": point.generation,
                "iteration": point.iteration,
                "world": point.world,
                "tp": sorted({len(g["ranks"]) for g in groups}),
                "stages": [g["layers"] for g in point.plan["replicas"][0]],
                "from_checkpoint": point.checkpoint_dir is not None,
                "run": run["run_name"],
                "final_state_hash": run["final_state_hash"],
            }
        )
    return out
