"""The soak's failure schedule (`unbroken bench soak`), as data: which fault fires where, drawn
from a seeded generator so a run can be repeated from the seed it prints.

One failure every 10-30 s of wall time, at a random rank and phase, of a kind drawn from every
kind the runtime injects on local CPU ranks. The schedule is made of iteration triggers
(`kind:rank=R,iter=I,phase=P`), not `at=SECONDS`: an iteration trigger names the same point of
the training whatever the machine's speed, so the fault-free reference and the audit stay
meaningful. Wall seconds are turned into iterations with the measured iteration time and a
per-kind estimate of what the previous failure costs (detection, recovery, recomputation):
`RECOVERY_COST_S`.

Rules the drawing keeps (each is a constraint of a fault kind, docs/faults.md):
- every kind appears once in the first `len(KINDS)` failures (in a seeded order), then kinds
  are drawn by `WEIGHTS`: a short soak still exercises every kind;
- `ckptcorrupt` is never the first failure (it needs a complete checkpoint on disk);
- `slow` stays active in its trainer process until that process is replaced, so the failure
  after a `slow` is a `kill` of the same rank: fail-slow stretches stay bounded and the steady
  iteration time stays comparable over the run;
- `lose` (a device gone for good) is left out: without `adapt.enabled` the job cannot continue
  on fewer ranks, and the soak measures repeated in-place recovery.

This module never starts a process and never imports torch.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from unbroken.bench.faults import PHASES

__all__ = [
    "FAILSTOP_KINDS",
    "KINDS",
    "PHASES",
    "RECOVERY_COST_S",
    "ScheduledFault",
    "draw_schedule",
]

KINDS = (
    "kill",
    "hang",
    "exception",
    "pageloss",
    "pageloss_beyond",
    "ckptcorrupt",
    "memspike",
    "slow",
)
"""The soak's fault kinds; `pageloss` is within the first tier's tolerance (recovered in
place), `pageloss_beyond` more pages than it tolerates (its rank is filled from a data-parallel
replica; checkpoint fallback without one)."""

WEIGHTS = {
    "kill": 4,
    "hang": 2,
    "exception": 2,
    "pageloss": 3,
    "pageloss_beyond": 1,
    "ckptcorrupt": 1,
    "memspike": 1,
    "slow": 1,
}
"""Relative frequency after the first round (crashes dominate, as in Leto's traces)."""

FAILSTOP_KINDS = frozenset(
    {"kill", "hang", "exception", "pageloss", "pageloss_beyond", "ckptcorrupt"}
)
"""Kinds that stop a trainer: each must be detected and recovered."""


RECOVERY_COST_S = {
    "hang": 6.0,
    "pageloss_beyond": 10.0,
    "ckptcorrupt": 4.0,
    "memspike": 0.5,
    "slow": 0.0,
}
"""Wall seconds a failure of each kind adds before training runs on (estimates on the 2-core
VM: a hang waits for the heartbeat timeout, 3 s, then recovers; a page loss beyond tolerance
restarted from a checkpoint and recomputed before its rank was filled from a replica, which is
faster: an overestimate only spaces the schedule wider); every other kind `DEFAULT_COST_S`. Only the
spacing of the schedule depends on them, never a check."""

DEFAULT_COST_S = 3.0
SLOW_FACTOR = 2.0
MEMSPIKE_MB = 64


@dataclass(frozen=True, slots=True)
class ScheduledFault:
    """One failure of the schedule."""

    kind: str
    """One of `KINDS`."""
    spec: str
    """The fault spec the job's `inject` list gets (docs/faults.md)."""
    iteration: int
    rank: int
    t_s: float
    """Planned wall seconds after the run's start (what the spacing aimed at)."""

    @property
    def failstop(self) -> bool:
        return self.kind in FAILSTOP_KINDS


def _spec(kind: str, rank: int, it: int, phase: str, rng: random.Random, parity: int) -> str:
    where = f"rank={rank},iter={it},phase={phase}"
    if kind == "pageloss":
        return f"pageloss:{where},pages={rng.randint(1, parity - 1)},parity=1"
    if kind == "pageloss_beyond":
        return f"pageloss:{where},pages={parity + rng.randint(1, 2)}"
    if kind == "memspike":
        return f"memspike:{where},mb={MEMSPIKE_MB}"
    if kind == "slow":
        return f"slow:rank={rank},iter={it},factor={SLOW_FACTOR:g}"
    return f"{kind}:{where}"


def _kinds(rng: random.Random, n: int) -> list[str]:
    """`n` kinds: every kind once (seeded order, `ckptcorrupt` not first), then weighted."""
    first = list(KINDS)
    rng.shuffle(first)
    if first[0] == "ckptcorrupt":
        first[0], first[1] = first[1], first[0]
    names = list(WEIGHTS)
    rest = rng.choices(names, weights=[WEIGHTS[k] for k in names], k=max(0, n - len(first)))
    return (first + rest)[:n]


def draw_schedule(
    seed: int,
    seconds: float,
    iter_s: float,
    world_size: int,
    parity_pages: int,
    gap_s: tuple[float, float] = (10.0, 30.0),
) -> tuple[list[ScheduledFault], int]:
    """The soak's failures and the job's iteration count.

    Args:
        seed: seeds the generator (same seed, same schedule).
        seconds: the faulty run's target wall time.
        iter_s: the measured fault-free iteration time.
        world_size: ranks (a failure's rank is drawn among them).
        parity_pages: the first tier's parity pages per group (its tolerance): a page loss
            within it loses fewer data pages plus one parity page, one beyond it more pages.
        gap_s: the wall time between failures is drawn uniformly from this range.

    Returns:
        The failures in iteration order, and the iterations that fill `seconds`.

    Raises:
        ValueError: a non-positive time, or a gap range that is empty.
    """
    if seconds <= 0 or iter_s <= 0 or not 0 < gap_s[0] <= gap_s[1]:
        raise ValueError("draw_schedule: seconds, iter_s and the gap range must be positive")
    rng = random.Random(seed)
    kinds = _kinds(rng, int(seconds / gap_s[0]) + 1)
    faults: list[ScheduledFault] = []
    t, it, cost = 0.0, 0, 0.0
    while kinds:
        gap = rng.uniform(*gap_s)
        if t + gap >= seconds:
            break
        t += gap
        it += max(3, round((gap - cost) / iter_s))
        rank = rng.randrange(world_size)
        if faults and faults[-1].kind == "slow":
            # End the slow trainer (module docstring); the kind drawn waits for the next turn.
            kind, rank = "kill", faults[-1].rank
        else:
            kind = kinds.pop(0)
        phase = rng.choice(PHASES)
        spec = _spec(kind, rank, it, phase, rng, parity_pages)
        faults.append(ScheduledFault(kind=kind, spec=spec, iteration=it, rank=rank, t_s=t))
        cost = RECOVERY_COST_S.get(kind, DEFAULT_COST_S)
    if faults and faults[-1].kind == "slow":  # no slow stretch runs to the end
        last = faults[-1]
        t += gap_s[0]
        it += max(3, round(gap_s[0] / iter_s))
        spec = _spec("kill", last.rank, it, rng.choice(PHASES), rng, parity_pages)
        faults.append(ScheduledFault(kind="kill", spec=spec, iteration=it, rank=last.rank, t_s=t))
        cost = DEFAULT_COST_S
    iterations = it + max(5, round((seconds - t - cost) / iter_s))
    return faults, iterations
