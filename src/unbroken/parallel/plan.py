"""The parallel plan: who holds which layers, who runs which micro-batch, and every rank's steps.

Owns `ParallelPlan`, the value the planner emits, the worker interpreter executes, and the
simulator and detector time ("Plans are data" in ARCHITECTURE.md). A plan is a pure
function of its inputs: every rank calls `make_plan` (or `plan_for`) with the same arguments and
gets an equal value, and `to_json`/`from_json` round-trip it exactly so the coordinator can ship
one instead.

[Note: rank numbering] `make_plan` numbers ranks replica-major, then stage, then TP position:
replica 0's stage 0 TP group takes the first ranks, then replica 0's stage 1, ..., then
replica 1. With a uniform TP degree t and pp stages that is ``rank = (d * pp + s) * t + i``. Plans
built from explicit `StageGroup`s (the planner's re-plans after failures) may use any distinct
non-negative ranks; ranks left out of every group are standbys and get no actions.

[Note: virtual stages] A replica lists one `StageGroup` per *virtual* stage (model chunk), in
model order. With v virtual stages per device and pp devices groups, virtual stage k runs on the
same ranks as stage ``k % pp`` (Megatron's interleaving), so ``len(stages) == pp * v``.

[Note: micro-batch ids] Micro-batch ids are global: replica d owns the contiguous range after
the ids of replicas 0..d-1. A `Migration` moves one (micro-batch, virtual stage) to another
replica's group for that stage (ResiHP §6.3); the id stays the same, so data order and
randomness, which are keyed by the id, do not change.

Never holds a process group or any global state; re-planning builds a new value.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from unbroken.parallel.actions import Action, parse_action
from unbroken.parallel.schedules import SCHEDULES, generate_actions

__all__ = [
    "Migration",
    "ParallelPlan",
    "Replica",
    "StageGroup",
    "held_stages",
    "make_plan",
    "plan_for",
    "same_layouts",
    "split_layers",
]

_FORMAT = "unbroken.parallel.plan/1"


def _is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


@dataclass(frozen=True, slots=True)
class StageGroup:
    """One virtual stage of one replica: its TP group and the layers it holds."""

    ranks: tuple[int, ...]
    """The TP group, in TP-position order; its size is a power of two (ResiHP §6.1)."""
    layers: tuple[int, int]
    """Half-open layer range [start, end) this stage computes."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "ranks", tuple(int(r) for r in self.ranks))
        object.__setattr__(self, "layers", (int(self.layers[0]), int(self.layers[1])))
        if not _is_power_of_two(len(self.ranks)):
            raise ValueError(
                f"TP group {self.ranks} has size {len(self.ranks)}, not a power of two"
            )
        if len(set(self.ranks)) != len(self.ranks) or min(self.ranks) < 0:
            raise ValueError(f"TP group {self.ranks} must hold distinct non-negative ranks")
        if not 0 <= self.layers[0] < self.layers[1]:
            raise ValueError(f"layer range {self.layers} must be non-empty and start at >= 0")

    @property
    def tp(self) -> int:
        """TP degree of this stage."""
        return len(self.ranks)


@dataclass(frozen=True, slots=True)
class Replica:
    """One data-parallel replica: its virtual stages in model order ([Note: virtual stages])."""

    stages: tuple[StageGroup, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "stages", tuple(self.stages))
        if not self.stages:
            raise ValueError("a replica needs at least one stage")


@dataclass(frozen=True, slots=True, order=True)
class Migration:
    """Run virtual stage `stage` of micro-batch `microbatch` on replica `replica` (ResiHP §6.3)."""

    microbatch: int
    stage: int
    replica: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ParallelPlan:
    """A complete hybrid-parallel plan for one iteration; see the module notes.

    Invariants are checked at construction (`validate`); a plan that exists is well formed.
    Whether its action lists can run without deadlock is a question for
    `unbroken.parallel.simulate` (or `unbroken.parallel.check`), not for the constructor.
    """

    replicas: tuple[Replica, ...]
    """DP replicas; all have the same number of (virtual) stages."""
    num_layers: int
    """Layers of the model; every replica's stages cover [0, num_layers) contiguously."""
    microbatches: tuple[int, ...]
    """Micro-batches owned by each replica ([Note: micro-batch ids])."""
    schedule: str
    """Schedule name, one of `unbroken.parallel.schedules.SCHEDULES`."""
    virtual_stages: int = 1
    """Virtual stages (model chunks) per device group: v of interleaved 1F1B."""
    migrations: tuple[Migration, ...] = ()
    """Stage-level micro-batch moves to another replica, sorted."""
    actions: Mapping[int, tuple[Action, ...]] = field(default_factory=dict)
    """Per rank, its ordered action list for one iteration."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "replicas", tuple(self.replicas))
        object.__setattr__(self, "microbatches", tuple(int(m) for m in self.microbatches))
        object.__setattr__(self, "migrations", tuple(sorted(self.migrations)))
        frozen = {int(r): tuple(a) for r, a in sorted(self.actions.items())}
        object.__setattr__(self, "actions", MappingProxyType(frozen))
        self.validate()

    # -- structure ------------------------------------------------------------------------
    @property
    def dp(self) -> int:
        """Number of data-parallel replicas."""
        return len(self.replicas)

    @property
    def num_stages(self) -> int:
        """Virtual stages per replica (pp * v)."""
        return len(self.replicas[0].stages)

    @property
    def pp(self) -> int:
        """Physical pipeline stages (device groups) per replica."""
        return self.num_stages // self.virtual_stages

    @property
    def ranks(self) -> tuple[int, ...]:
        """Every rank that holds a stage, sorted."""
        return tuple(
            sorted(r for rep in self.replicas for g in rep.stages[: self.pp] for r in g.ranks)
        )

    @property
    def total_microbatches(self) -> int:
        """Micro-batches over all replicas."""
        return sum(self.microbatches)

    def microbatch_ids(self, replica: int) -> range:
        """Global ids of the micro-batches replica `replica` owns."""
        start = sum(self.microbatches[:replica])
        return range(start, start + self.microbatches[replica])

    def owner(self, microbatch: int) -> int:
        """Replica that owns `microbatch` (whose data it is)."""
        for d in range(self.dp):
            if microbatch in self.microbatch_ids(d):
                return d
        raise ValueError(f"micro-batch {microbatch} is not in this plan")

    def executor(self, microbatch: int, stage: int) -> int:
        """Replica whose group runs virtual stage `stage` of `microbatch` (after migrations)."""
        for m in self.migrations:
            if (m.microbatch, m.stage) == (microbatch, stage):
                return m.replica
        return self.owner(microbatch)

    def placement(self) -> dict[tuple[int, int], int]:
        """The explicit placement (micro-batch, virtual stage) -> replica for every pair."""
        moved = {(m.microbatch, m.stage): m.replica for m in self.migrations}
        return {
            (mb, k): moved.get((mb, k), d)
            for d in range(self.dp)
            for mb in self.microbatch_ids(d)
            for k in range(self.num_stages)
        }

    def locate(self, rank: int) -> tuple[int, int]:
        """(replica, physical stage) of `rank`.

        Raises:
            KeyError: the rank holds no stage (a standby).
        """
        for d, rep in enumerate(self.replicas):
            for s, group in enumerate(rep.stages[: self.pp]):
                if rank in group.ranks:
                    return d, s
        raise KeyError(f"rank {rank} holds no stage in this plan")

    # -- invariants -----------------------------------------------------------------------
    def validate(self) -> None:
        """Check the plan's invariants.

        Raises:
            ValueError: naming the first violated invariant.
        """
        self._validate_schedule()
        num_stages = self.num_stages
        seen: dict[int, tuple[int, int]] = {}
        for d, rep in enumerate(self.replicas):
            if len(rep.stages) != num_stages:
                raise ValueError(
                    f"replica {d} has {len(rep.stages)} stages, replica 0 has {num_stages}"
                )
            self._validate_replica(d, rep, seen)
        if len(self.microbatches) != self.dp:
            raise ValueError(f"{len(self.microbatches)} micro-batch counts for {self.dp} replicas")
        if min(self.microbatches) < 0 or self.total_microbatches < 1:
            raise ValueError(f"micro-batch counts {self.microbatches} must be >= 0, total >= 1")
        self._validate_migrations()
        self._validate_actions(seen)

    def _validate_schedule(self) -> None:
        """Replicas exist; schedule, virtual stages, stage count and layer count agree."""
        if not self.replicas:
            raise ValueError("a plan needs at least one replica")
        if self.schedule not in SCHEDULES:
            raise ValueError(
                f"unknown schedule {self.schedule!r}; choose one of {sorted(SCHEDULES)}"
            )
        v = self.virtual_stages
        if v < 1:
            raise ValueError(f"virtual_stages must be >= 1, got {v}")
        if (v > 1) != (self.schedule == "interleaved_1f1b"):
            raise ValueError("virtual_stages > 1 goes with the 'interleaved_1f1b' schedule only")
        if self.num_stages % v:
            raise ValueError(f"{self.num_stages} stages per replica is not a multiple of v={v}")
        if self.num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {self.num_layers}")

    def _validate_actions(self, seen: dict[int, tuple[int, int]]) -> None:
        """Action lists exactly for the ranks that hold a stage (`seen`), naming only known
        peers, stages and micro-batches."""
        num_stages = self.num_stages
        if self.actions and set(self.actions) != set(seen):
            missing = sorted(set(seen) - set(self.actions))
            extra = sorted(set(self.actions) - set(seen))
            raise ValueError(
                f"action lists do not match the ranks: missing {missing}, extra {extra}"
            )
        for rank, acts in self.actions.items():
            for a in acts:
                if a.peer is not None and a.peer not in seen:
                    raise ValueError(f"rank {rank}: {a} names a peer that holds no stage")
                if a.stage is not None and a.stage >= num_stages:
                    raise ValueError(f"rank {rank}: {a} names stage {a.stage} of {num_stages}")
                if a.microbatch is not None and a.microbatch >= self.total_microbatches:
                    raise ValueError(f"rank {rank}: {a} names an unknown micro-batch")

    def _validate_replica(self, d: int, rep: Replica, seen: dict[int, tuple[int, int]]) -> None:
        pp = self.pp
        for k, group in enumerate(rep.stages):
            if k >= pp and group.ranks != rep.stages[k % pp].ranks:
                raise ValueError(
                    f"replica {d} virtual stage {k} must run on the ranks of stage {k % pp} "
                    f"{rep.stages[k % pp].ranks}, got {group.ranks}"
                )
            if k < pp:
                for r in group.ranks:
                    if r in seen:
                        raise ValueError(f"rank {r} is in two stage groups: {seen[r]} and {(d, k)}")
                    seen[r] = (d, k)
        edge = 0
        for k, group in enumerate(rep.stages):
            if group.layers[0] != edge:
                raise ValueError(
                    f"replica {d} stage {k} starts at layer {group.layers[0]}, expected {edge}: "
                    "layer ranges must cover [0, num_layers) contiguously"
                )
            edge = group.layers[1]
        if edge != self.num_layers:
            raise ValueError(f"replica {d} covers layers [0, {edge}), not [0, {self.num_layers})")

    def _validate_migrations(self) -> None:
        pairs = set()
        for m in self.migrations:
            if not 0 <= m.microbatch < self.total_microbatches:
                raise ValueError(f"{m}: unknown micro-batch")
            if not 0 <= m.stage < self.num_stages or not 0 <= m.replica < self.dp:
                raise ValueError(f"{m}: stage or replica out of range")
            if (m.microbatch, m.stage) in pairs:
                raise ValueError(f"{m}: micro-batch {m.microbatch} stage {m.stage} moved twice")
            pairs.add((m.microbatch, m.stage))
            src = self.replicas[self.owner(m.microbatch)].stages[m.stage].layers
            dst = self.replicas[m.replica].stages[m.stage].layers
            if src != dst:
                raise ValueError(
                    f"{m}: layers {src} of the owner differ from {dst} of the executor"
                )
        if self.migrations and self.virtual_stages > 1:
            raise ValueError("micro-batch migration is not supported with virtual stages")

    # -- serialization --------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict; actions in their text form."""
        return {
            "format": _FORMAT,
            "schedule": self.schedule,
            "num_layers": self.num_layers,
            "virtual_stages": self.virtual_stages,
            "microbatches": list(self.microbatches),
            "replicas": [
                [{"ranks": list(g.ranks), "layers": list(g.layers)} for g in rep.stages]
                for rep in self.replicas
            ],
            "migrations": [[m.microbatch, m.stage, m.replica] for m in self.migrations],
            "actions": {str(r): [str(a) for a in acts] for r, acts in self.actions.items()},
        }

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        """Pickle through JSON (the read-only `actions` mapping does not pickle by itself)."""
        return (ParallelPlan.from_json, (self.to_json(),))

    def to_json(self, indent: int | None = None) -> str:
        """Serialize; `from_json(plan.to_json()) == plan` for every plan."""
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ParallelPlan:
        """Inverse of `to_dict`.

        Raises:
            ValueError: wrong format tag, a malformed action, or a violated invariant.
        """
        if data.get("format") != _FORMAT:
            raise ValueError(
                f"not a parallel plan (format {data.get('format')!r}, want {_FORMAT!r})"
            )
        return cls(
            replicas=tuple(
                Replica(tuple(StageGroup(tuple(g["ranks"]), tuple(g["layers"])) for g in rep))
                for rep in data["replicas"]
            ),
            num_layers=int(data["num_layers"]),
            microbatches=tuple(data["microbatches"]),
            schedule=str(data["schedule"]),
            virtual_stages=int(data["virtual_stages"]),
            migrations=tuple(Migration(*map(int, m)) for m in data["migrations"]),
            actions={
                int(r): tuple(parse_action(a) for a in acts) for r, acts in data["actions"].items()
            },
        )

    @classmethod
    def from_json(cls, text: str) -> ParallelPlan:
        """Inverse of `to_json`."""
        return cls.from_dict(json.loads(text))

    def stage_records(self) -> list[dict[str, Any]]:
        """Each stage of each replica as a JSON record: replica, stage, ranks, layers, TP."""
        return [
            {"replica": d, "stage": s, "ranks": list(g.ranks), "layers": list(g.layers), "tp": g.tp}
            for d, rep in enumerate(self.replicas)
            for s, g in enumerate(rep.stages)
        ]

    def describe(self) -> str:
        """One line per rank: ``r3 (replica 0, stage 1): 1RECV_F0<-r1 1F0 ...`` for humans."""
        lines = [f"{self.schedule}: dp={self.dp} pp={self.pp} v={self.virtual_stages}"]
        for rank, acts in self.actions.items():
            d, s = self.locate(rank)
            lines.append(f"r{rank} (replica {d}, stage {s}): " + " ".join(map(str, acts)))
        return "\n".join(lines)


def held_stages(plan: ParallelPlan, rank: int) -> tuple[tuple[tuple[int, int], int], ...]:
    """(layer range, TP degree) of every virtual stage `rank` holds: what its state is.

    Raises:
        KeyError: the rank holds no stage (a standby).
    """
    d, s = plan.locate(rank)
    stages = plan.replicas[d].stages
    return tuple((g.layers, g.tp) for k, g in enumerate(stages) if k % plan.pp == s)


def same_layouts(plan: ParallelPlan) -> bool:
    """True when every replica holds the same layer ranges with the same TP degrees, so
    gradients can be averaged (or folded in order) position by position over whole flat
    buffers."""
    first = [(g.layers, g.tp) for g in plan.replicas[0].stages]
    return all([(g.layers, g.tp) for g in rep.stages] == first for rep in plan.replicas[1:])


def split_layers(
    num_layers: int, num_stages: int, weights: Sequence[float] | None = None
) -> tuple[int, ...]:
    """Layer counts per stage, proportional to `weights` (default: even), each at least 1.

    Largest-remainder rounding with ties to the earlier stage, so the split is deterministic.
    Pass per-stage throughput as weights to give a slow stage fewer layers (ResiHP §6.2).

    Raises:
        ValueError: fewer layers than stages, or a non-positive weight.
    """
    if num_stages < 1 or num_layers < num_stages:
        raise ValueError(f"cannot split {num_layers} layers into {num_stages} non-empty stages")
    w = [1.0] * num_stages if weights is None else [float(x) for x in weights]
    if len(w) != num_stages or min(w) <= 0:
        raise ValueError(f"need {num_stages} positive stage weights, got {weights}")
    spare = num_layers - num_stages
    exact = [spare * x / sum(w) for x in w]
    counts = [int(e) for e in exact]
    order = sorted(range(num_stages), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in order[: spare - sum(counts)]:
        counts[i] += 1
    return tuple(c + 1 for c in counts)


def plan_for(
    replicas: Sequence[Replica],
    microbatches: Sequence[int],
    schedule: str,
    *,
    virtual_stages: int = 1,
    migrations: Sequence[Migration] = (),
) -> ParallelPlan:
    """Generate the action lists for a given layout (the planner's entry point).

    Args:
        replicas: the layout; ranks may be any distinct non-negative ints.
        microbatches: micro-batches owned by each replica.
        schedule: one of `SCHEDULES`.
        virtual_stages: v for interleaved 1F1B.
        migrations: stage-level moves of micro-batches to other replicas.

    Returns:
        The validated plan with every rank's actions.

    Raises:
        ValueError: an invalid layout or a schedule constraint (e.g. interleaving needs the
            micro-batch count to be a multiple of pp).
    """
    skeleton = ParallelPlan(
        replicas=tuple(replicas),
        num_layers=replicas[0].stages[-1].layers[1] if replicas else 0,
        microbatches=tuple(microbatches),
        schedule=schedule,
        virtual_stages=virtual_stages,
        migrations=tuple(migrations),
    )
    actions = generate_actions(
        stage_ranks=[[g.ranks for g in rep.stages] for rep in skeleton.replicas],
        microbatches=skeleton.microbatches,
        schedule=schedule,
        virtual_stages=virtual_stages,
        executors={(m.microbatch, m.stage): m.replica for m in skeleton.migrations},
    )
    return ParallelPlan(
        replicas=skeleton.replicas,
        num_layers=skeleton.num_layers,
        microbatches=skeleton.microbatches,
        schedule=schedule,
        virtual_stages=virtual_stages,
        migrations=skeleton.migrations,
        actions=actions,
    )


# Long: a 22-line docstring for its 10 parameters; the body is 38 lines.
def make_plan(
    dp: int,
    pp: int,
    tp: int | Sequence[int] | Sequence[Sequence[int]],
    num_layers: int,
    microbatches: int | Sequence[int],
    schedule: str = "1f1b",
    layer_split: Sequence[int] | None = None,
    virtual_stages: int = 1,
    *,
    stage_weights: Sequence[float] | None = None,
    migrations: Sequence[Migration] = (),
) -> ParallelPlan:
    """Build a plan from parallel degrees, numbering ranks as in [Note: rank numbering].

    Args:
        dp: data-parallel replicas.
        pp: physical pipeline stages per replica.
        tp: TP degree: one for all, one per stage, or one list of per-stage degrees per replica.
        num_layers: model layers.
        microbatches: micro-batches per replica (one count for all, or one per replica).
        schedule: ``gpipe``, ``1f1b``, ``interleaved_1f1b`` or ``zb_h1``.
        layer_split: layers per virtual stage (pp * v counts summing to num_layers); default
            even, or proportional to `stage_weights`.
        stage_weights: relative throughput per virtual stage, used when `layer_split` is None.
        virtual_stages: v, model chunks per device group (interleaved 1F1B only).
        migrations: stage-level micro-batch moves between replicas.

    Returns:
        The plan; equal inputs give equal plans.

    Raises:
        ValueError: incompatible degrees, a TP degree that is not a power of two, a layer split
            that does not cover the model, or a schedule constraint.
    """
    if dp < 1 or pp < 1:
        raise ValueError(f"dp and pp must be >= 1, got dp={dp} pp={pp}")
    if isinstance(tp, int):
        tps = [[tp] * pp for _ in range(dp)]
    elif tp and all(isinstance(t, int) for t in tp):
        tps = [[int(t) for t in tp] for _ in range(dp)]  # type: ignore[union-attr]
    else:
        tps = [[int(t) for t in row] for row in tp]  # type: ignore[union-attr]
    if len(tps) != dp or any(len(row) != pp for row in tps):
        raise ValueError(f"tp must give {pp} degrees per stage for {dp} replicas, got {tp}")
    counts = [microbatches] * dp if isinstance(microbatches, int) else list(microbatches)
    num_stages = pp * virtual_stages
    split = (
        tuple(layer_split)
        if layer_split is not None
        else split_layers(num_layers, num_stages, stage_weights)
    )
    if len(split) != num_stages or sum(split) != num_layers or min(split) < 1:
        raise ValueError(
            f"layer_split {split} must give {num_stages} positive counts summing to {num_layers}"
        )
    edges = [sum(split[:k]) for k in range(num_stages + 1)]
    replicas, next_rank = [], 0
    for d in range(dp):
        groups = []
        for s in range(pp):
            if not _is_power_of_two(tps[d][s]):
                raise ValueError(
                    f"replica {d} stage {s}: TP degree {tps[d][s]} is not a power of two"
                )
            groups.append(tuple(range(next_rank, next_rank + tps[d][s])))
            next_rank += tps[d][s]
        stages = tuple(
            StageGroup(groups[k % pp], (edges[k], edges[k + 1])) for k in range(num_stages)
        )
        replicas.append(Replica(stages))
    return plan_for(
        replicas, counts, schedule, virtual_stages=virtual_stages, migrations=migrations
    )
