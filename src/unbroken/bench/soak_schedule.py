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
- with more than one node (`nodes`), `lose` (a device gone for good) and `nodeloss` (a whole
  node gone at once) hit a rank of the last node, and the job re-plans onto the others
  (`adapt.enabled`). The harness then brings the node back the way an operator would: when
  its agent is gone it clears the node's lost-device records (hardware replaced) and starts
  the agent again, and the job grows back to its launch world. A lost device alone leaves
  its node's agent running, so the failure after a `lose` is always the `nodeloss` of that
  node (the node is replaced as a whole), and for `NODE_BACK_S` after a `nodeloss` failures
  hit ranks of node 0, which every world of the job holds;
- with one node there is nothing to re-plan onto: `lose` and `nodeloss` are left out.

This module never starts a process and never imports torch.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

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
    "lose",
    "nodeloss",
)
"""The soak's fault kinds (`lose` and `nodeloss` only with more than one node); `pageloss` is within the first tier's tolerance (recovered in
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
    "lose": 1,
    "nodeloss": 1,
}
"""Relative frequency after the first round (crashes dominate, as in Leto's traces)."""

FAILSTOP_KINDS = frozenset(
    {"kill", "hang", "exception", "pageloss", "pageloss_beyond", "ckptcorrupt", "lose", "nodeloss"}
)
"""Kinds that stop a trainer: each must be detected and recovered."""


RECOVERY_COST_S = {
    "hang": 6.0,
    "pageloss_beyond": 10.0,
    "ckptcorrupt": 4.0,
    "memspike": 0.5,
    "slow": 0.0,
    "nodeloss": 4.0,
}
"""Wall seconds a failure of each kind adds before training runs on (estimates on the 2-core
VM: a hang waits for the heartbeat timeout, 3 s, then recovers; a page loss beyond tolerance
restarted from a checkpoint and recomputed before its rank was filled from a replica, which is
faster: an overestimate only spaces the schedule wider; a node loss costs its own recovery and
the planned stop that grows the world back, while the survivors train in between:
`NODE_BACK_S`); every other kind `DEFAULT_COST_S`. Only the
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


def _kinds(rng: random.Random, n: int, kinds: tuple[str, ...]) -> list[str]:
    """`n` of `kinds`: each once (seeded order, `ckptcorrupt` not first), then weighted."""
    first = list(kinds)
    rng.shuffle(first)
    if first[0] == "ckptcorrupt":
        first[0], first[1] = first[1], first[0]
    names = [k for k in WEIGHTS if k in kinds]
    rest = rng.choices(names, weights=[WEIGHTS[k] for k in names], k=max(0, n - len(first)))
    return (first + rest)[:n]


NODE_BACK_S = 40.0
"""Planned wall seconds after a `nodeloss` during which failures hit node 0's ranks only: the
keeper starts the node's agent again after 1 s, and the job grows back at a planned stop once
the node's fresh trainers are up (a few seconds; ~10 s on the loaded 2-core VM). A failure
scheduled on a rank of a node that is not back would never fire."""


@dataclass(slots=True)
class _Drawing:
    """The state the drawing keeps between failures: the rules of the module docstring."""

    rng: random.Random
    kinds: list[str]
    world: int
    nodes: int
    lost: set[int] = field(default_factory=set)
    """Devices of the last node lost since it was last replaced. A fault's `rank=` names a
    device (the rank at launch: `unbroken.launch.session`), so a fault for a lost device
    never fires."""
    node_back_t: float = float("-inf")
    """Planned time from which the last node is assumed back after a `nodeloss`."""

    @property
    def per_node(self) -> int:
        return self.world // self.nodes

    def next(self, prev: ScheduledFault | None, t: float) -> tuple[str, int]:
        """The next failure's (kind, rank in the world running then), planned at `t`."""
        rng, last_node = self.rng, range(self.world - self.per_node, self.world)
        drawn = rng.randrange(self.world)  # drawn first, whatever follows: one seed, one draw
        if prev is not None and prev.kind == "slow":
            return "kill", prev.rank  # end the slow trainer; the kind drawn waits
        if prev is not None and prev.kind == "lose":
            # A device of that node that is still there (not the one just lost).
            return "nodeloss", min(d for d in last_node if d not in self.lost)
        if t < self.node_back_t:
            # Node 0's ranks exist in every world; a loss waits for the whole world.
            k = next((i for i, k in enumerate(self.kinds) if k not in ("lose", "nodeloss")), None)
            kind = self.kinds.pop(k) if k is not None else "kill"
            return kind, drawn % self.per_node
        kind = self.kinds.pop(0)
        if kind in ("lose", "nodeloss"):
            return kind, rng.choice(last_node)
        return kind, drawn

    def fired(self, kind: str, rank: int, t: float) -> None:
        if kind == "lose":
            self.lost.add(rank)
        elif kind == "nodeloss":
            self.lost.clear()
            self.node_back_t = t + NODE_BACK_S


def _closing(prev: ScheduledFault) -> str | None:
    """The failure a schedule may not end on without: a slow stretch or a lost device must
    end before the job does."""
    return {"slow": "kill", "lose": "nodeloss"}.get(prev.kind)


def draw_schedule(
    seed: int,
    seconds: float,
    iter_s: float,
    world_size: int,
    parity_pages: int,
    gap_s: tuple[float, float] = (10.0, 30.0),
    nodes: int = 1,
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
        nodes: the job's nodes (ranks split evenly, in order); with more than one, lost
            devices and lost nodes are drawn too (module docstring).

    Returns:
        The failures in iteration order, and the iterations that fill `seconds`.

    Raises:
        ValueError: a non-positive time, or a gap range that is empty, or ranks that the
            nodes do not split evenly.
    """
    if seconds <= 0 or iter_s <= 0 or not 0 < gap_s[0] <= gap_s[1]:
        raise ValueError("draw_schedule: seconds, iter_s and the gap range must be positive")
    if nodes < 1 or world_size % nodes:
        raise ValueError(f"draw_schedule: {world_size} ranks do not split over {nodes} nodes")
    rng = random.Random(seed)
    kinds = KINDS if nodes > 1 else tuple(k for k in KINDS if k not in ("lose", "nodeloss"))
    drawing = _Drawing(rng, _kinds(rng, int(seconds / gap_s[0]) + 1, kinds), world_size, nodes)
    faults: list[ScheduledFault] = []
    t, it, cost = 0.0, 0, 0.0

    def add(gap: float, spent: float) -> None:
        nonlocal t, it, cost
        kind, rank = drawing.next(faults[-1] if faults else None, t + gap)
        t += gap
        it += max(3, round((gap - spent) / iter_s))
        spec = _spec(kind, rank, it, rng.choice(PHASES), rng, parity_pages)
        faults.append(ScheduledFault(kind=kind, spec=spec, iteration=it, rank=rank, t_s=t))
        drawing.fired(kind, rank, t)
        cost = RECOVERY_COST_S.get(kind, DEFAULT_COST_S)

    while drawing.kinds:
        gap = rng.uniform(*gap_s)
        if t + gap >= seconds:
            break
        add(gap, cost)
    while faults and (kind := _closing(faults[-1])) is not None:
        add(max(gap_s[0], cost), 0.0)
        assert faults[-1].kind == kind
    tail = max(5, round((seconds - t - cost) / iter_s))
    if faults and faults[-1].kind == "nodeloss":  # the node's return and the grown world
        tail = max(tail, round(NODE_BACK_S / iter_s))
    return faults, it + tail
