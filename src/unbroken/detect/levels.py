"""Fail-slow severity levels: the slow-down factor that costs a given share of throughput.

ResiHP §8.3 (following Greyhound and Adaptra) injects weak, medium and severe fail-slows that
cut the unmitigated throughput by roughly 35%, 55% and 70%. In a data-parallel job every rank
waits for the slowest at the gradient all-reduce, so one slowed rank sets the pace. If a share
s of that rank's iteration is stretched by F (the `slow` fault stalls (F - 1) x each phase step
it hooks) and the rest is not, the iteration takes F' = (1 - s) + s * F times as long, and

    throughput loss L = 1 - 1 / F'   =>   F = 1 + (1 / (1 - L) - 1) / s.

With s = 1 (the compute `slow` fault stretches every phase step but the all-reduce buckets:
forward, backward, protect, sync, update chunks) the factors are 1.54 (weak), 2.22 (medium),
3.33 (severe). The bench measures the loss these factors really cause and prints it next to the
target.

Communication slow-down (a slow link or NIC): the same formula with s = the communication share
of the iteration, `comm_factor_for`. The injector (`slow ... what=comm,level=L`, [Note:
slow-fault] in `unbroken.inject.injector`) measures s on the rank before the fault and stalls
after each gradient all-reduce bucket (hooks `Phase.ALLREDUCE` / `Phase.REDUCED` in
`unbroken.train.loop`), so the stall per iteration is L / (1 - L) of the healthy iteration.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from types import MappingProxyType

__all__ = ["LEVEL_LOSS", "Level", "comm_factor_for", "slow_factor_for", "throughput_loss"]


class Level(enum.StrEnum):
    WEAK = "weak"
    MEDIUM = "medium"
    SEVERE = "severe"


LEVEL_LOSS: Mapping[Level, float] = MappingProxyType(
    {Level.WEAK: 0.35, Level.MEDIUM: 0.55, Level.SEVERE: 0.70}
)
"""Unmitigated throughput loss of each level (ResiHP §8.3)."""


def slow_factor_for(level: Level | str, slowed_share: float = 1.0) -> float:
    """The `slow` factor F that costs the level's throughput loss in a data-parallel job.

    Args:
        level: weak, medium or severe.
        slowed_share: share s of the slowed rank's iteration that the fault stretches.

    Raises:
        ValueError: unknown level or s not in (0, 1].
    """
    if not 0.0 < slowed_share <= 1.0:
        raise ValueError(f"slowed_share must be in (0, 1], got {slowed_share}")
    loss = LEVEL_LOSS[Level(level)]
    return 1.0 + (1.0 / (1.0 - loss) - 1.0) / slowed_share


def comm_factor_for(level: Level | str, comm_share: float) -> float:
    """Factor F by which the all-reduce must slow down to cost the level's throughput loss,
    when it is a share `comm_share` of the slowed rank's healthy iteration."""
    return slow_factor_for(level, comm_share)


def throughput_loss(factor: float, slowed_share: float = 1.0) -> float:
    """Inverse of `slow_factor_for`: the loss that factor F costs."""
    return 1.0 - 1.0 / ((1.0 - slowed_share) + slowed_share * factor)
