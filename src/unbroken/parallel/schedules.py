"""Pipeline schedules as per-rank action lists: GPipe, 1F1B, interleaved 1F1B and ZB-H1.

Owns two things: the order in which each stage's TP group runs its compute (F, B, W) for a
schedule, and the placement of the point-to-point actions around that compute. Works on plain
rank tuples so that `unbroken.parallel.plan` can call it without an import cycle.

[Note: communication placement] Between two consecutive compute actions c_i and c_{i+1} of a
rank sits one *batch*: the sends of c_i's outputs followed by the receives c_{i+1} needs. A
runtime posts a batch together (``batch_isend_irecv``) and waits for all of it before c_{i+1};
this is Megatron's ``send_forward_recv_backward`` pattern, and it is what keeps blocking
(rendezvous) sends of NCCL/gloo from deadlocking: two neighbours that send to each other post
both directions in the same batch. Messages on one directed link are matched in FIFO order, as
NCCL does. `unbroken.parallel.simulate` checks both properties for any action list.

[Note: migration placement] With micro-batches migrated between replicas, groups run different
micro-batch sets and the adjacent-neighbour pairing above no longer lines up (a group may send
F_j to a peer that runs B_i first). Then each receive is placed by a witness instead: the compute
orders are replayed at unit cost with instant transfers, and the receive of a message produced
at time t goes into the receiver's batch at time t. Every transfer then sits at the same instant
on both ends of the witness, which is itself a blocking-send execution, so the lists cannot
deadlock; the price is that a receive may be posted earlier than strictly needed.

[Note: heterogeneous TP transfers] A message from a TP group of size a to one of size b is split
into N = max(a, b) chunks (ResiHP §7, Figure 7): chunk c goes from sender ``c * a // N`` to
receiver ``c * b // N`` (positions in the groups), so each chunk crosses the link exactly once and
the receivers all-gather the full tensor. Equal degrees give Megatron's scatter/gather.

Never imports torch; never touches a process group.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping, Sequence

from unbroken.parallel.actions import Action, ActionKind

__all__ = ["SCHEDULES", "compute_orders", "compute_steps", "generate_actions", "p2p_chunks"]

SCHEDULES = frozenset({"gpipe", "1f1b", "interleaved_1f1b", "zb_h1"})
"""Schedule names accepted by `generate_actions`."""

Step = tuple[ActionKind, int, int]
"""(kind, virtual stage, micro-batch) of one compute action."""
F, B, W = ActionKind.F, ActionKind.B, ActionKind.W


def p2p_chunks(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """Chunks of one message from TP group `src` to TP group `dst` ([Note: heterogeneous TP
    transfers]).

    Returns:
        ``(chunk, sender rank, receiver rank)`` for each of the max(len(src), len(dst)) chunks.
    """
    a, b = len(src), len(dst)
    n = max(a, b)
    return [(c, src[c * a // n], dst[c * b // n]) for c in range(n)]


def _gpipe(mbs: Sequence[int], stage: int, pp: int) -> list[Step]:
    return [(F, stage, m) for m in mbs] + [(B, stage, m) for m in mbs]


def _one_f_one_b(mbs: Sequence[int], stage: int, pp: int) -> list[Step]:
    warmup = min(pp - stage - 1, len(mbs))
    order: list[Step] = [(F, stage, m) for m in mbs[:warmup]]
    for i in range(len(mbs) - warmup):
        order += [(F, stage, mbs[warmup + i]), (B, stage, mbs[i])]
    order += [(B, stage, m) for m in mbs[len(mbs) - warmup :]]
    return order


def _interleaved(mbs: Sequence[int], stage: int, pp: int, v: int) -> list[list[Step]]:
    """Megatron's interleaved 1F1B for one device group holding v model chunks, as steps.

    Steps follow Megatron's communication rhythm: one F per warm-up step, an (F, B) pair per
    steady step, one B per cool-down step; the p2p batch sits between steps.
    """
    n = len(mbs)
    if n % pp:
        raise ValueError(
            f"interleaved 1F1B needs the micro-batch count ({n}) to be a multiple of pp ({pp})"
        )
    total = n * v

    def step(kind: ActionKind, k: int) -> Step:
        chunk = (k // pp) % v
        if kind is B:
            chunk = v - 1 - chunk
        return (kind, chunk * pp + stage, mbs[(k // (pp * v)) * pp + k % pp])

    warmup = total if n == pp else min((pp - stage - 1) * 2 + (v - 1) * pp, total)
    steps = [[step(F, k)] for k in range(warmup)]
    steps += [[step(F, warmup + i), step(B, i)] for i in range(total - warmup)]
    steps += [[step(B, k)] for k in range(total - warmup, total)]
    return steps


def _list_schedule(
    work: Mapping[tuple[int, int], Sequence[int]], pp: int, schedule: str
) -> dict[tuple[int, int], list[Step]]:
    """Compute orders by list scheduling at unit costs: ZB-H1, and any schedule with migration.

    Each group runs its micro-batches in list order; whenever it is free it starts the first
    ready of, by priority:

    - ``zb_h1`` (the zero-bubble paper's H1 heuristic): the next B (its input gradient is on
      the critical path); the next F if fewer than pp - s micro-batches are between F and B
      (1F1B's activation bound) and fewer than pp weight gradients are deferred; else the oldest
      deferred W. Deferred W's fill the cool-down bubble; with equal F, B and W costs the
      iteration takes M(F+B+W) + (pp-1)(F+B-W) for M >= pp, against 1F1B's (M+pp-1)(F+B+W).
    - ``1f1b``: the next B, else the next F within the pp - s bound.
    - ``gpipe``: every F, then the B's.

    The result is a unit-cost execution, so the orders of all groups are mutually consistent
    even when groups run different micro-batch sets (migration). Should the activation bounds
    ever stall every group, an F is let through regardless, which always makes progress.
    """
    return _ListScheduler(work, pp, schedule).run()


class _ListScheduler:
    """The state of one `_list_schedule` run: per group its clock and how many F, B and W it
    has run; when each (micro-batch, stage) finished F and B; the orders built so far; and a
    heap of each group's best candidate."""

    def __init__(
        self, work: Mapping[tuple[int, int], Sequence[int]], pp: int, schedule: str
    ) -> None:
        self.work, self.pp, self.schedule = work, pp, schedule
        self.groups = sorted(work)
        self.split = schedule == "zb_h1"
        self.clock = dict.fromkeys(self.groups, 0)
        self.nf = dict.fromkeys(self.groups, 0)
        self.nb = dict.fromkeys(self.groups, 0)
        self.nw = dict.fromkeys(self.groups, 0)
        self.f_done: dict[tuple[int, int], int] = {}
        self.b_done: dict[tuple[int, int], int] = {}
        self.orders: dict[tuple[int, int], list[Step]] = {g: [] for g in self.groups}
        # Each group's best candidate sits in a heap; it changes only when the group itself or
        # the producer it waits for advances, so only those are refreshed (stale entries are
        # skipped).
        self.executor_of = {(m, g[1]): g for g in self.groups for m in work[g]}
        self.heap: list[tuple[int, int, tuple[int, int], int, ActionKind]] = []
        self.version = dict.fromkeys(self.groups, 0)

    def run(self) -> dict[tuple[int, int], list[Step]]:
        remaining = sum((3 if self.split else 2) * len(self.work[g]) for g in self.groups)
        for g in self.groups:
            self._refresh(g)
        while remaining:
            start, g, kind = self._next()
            self._execute(start, g, kind)
            remaining -= 1
        return self.orders

    def _bounded(self, g: tuple[int, int]) -> bool:
        if self.schedule == "gpipe":
            return True
        nf, nb, nw = self.nf, self.nb, self.nw
        within = nf[g] - nb[g] < self.pp - g[1]
        return within and (nb[g] - nw[g] < self.pp if self.split else True)

    def _candidates(self, g: tuple[int, int], relaxed: bool) -> list[tuple[int, int, ActionKind]]:
        mbs, s = self.work[g], g[1]
        nf, nb, nw, clock = self.nf, self.nb, self.nw, self.clock
        found = []
        f_prio, b_prio = (0, 1) if self.schedule == "gpipe" else (1, 0)
        if nb[g] < nf[g] and (self.schedule != "gpipe" or nf[g] == len(mbs)):
            m = mbs[nb[g]]
            ready = self.f_done[(m, s)] if s == self.pp - 1 else self.b_done.get((m, s + 1))
            if ready is not None:
                found.append((max(clock[g], ready), b_prio, B))
        if nf[g] < len(mbs) and (relaxed or self._bounded(g)):
            ready = 0 if s == 0 else self.f_done.get((mbs[nf[g]], s - 1))
            if ready is not None:
                found.append((max(clock[g], ready), f_prio, F))
        if self.split and nw[g] < nb[g]:
            found.append((clock[g], 2, W))
        return found

    def _refresh(self, g: tuple[int, int]) -> None:
        self.version[g] += 1
        found = self._candidates(g, relaxed=False)
        if found:
            start, prio, kind = min(found)
            heapq.heappush(self.heap, (start, prio, g, self.version[g], kind))

    def _next(self) -> tuple[int, tuple[int, int], ActionKind]:
        """(start, group, kind) of the next compute action to run."""
        best: tuple[int, int, tuple[int, int], ActionKind] | None = None
        while self.heap and best is None:
            start, prio, g, ver, kind = heapq.heappop(self.heap)
            if ver == self.version[g]:
                best = (start, prio, g, kind)
        if best is None:  # every group is held by its bounds: let an F through
            for g in self.groups:
                found = self._candidates(g, relaxed=True)
                if found and (best is None or min(found)[:2] < best[:2]):
                    start, prio, kind = min(found)
                    best = (start, prio, g, kind)
        if best is None:  # pragma: no cover - an F is always ready once bounds are relaxed
            raise RuntimeError("list scheduler stalled")
        start, _, g, kind = best
        return start, g, kind

    def _execute(self, start: int, g: tuple[int, int], kind: ActionKind) -> None:
        s = g[1]
        counter = {F: self.nf, B: self.nb, W: self.nw}[kind]
        m = self.work[g][counter[g]]
        counter[g] += 1
        self.clock[g] = start + 1
        if kind is F:
            self.f_done[(m, s)] = start + 1
        elif kind is B:
            self.b_done[(m, s)] = start + 1
        self.orders[g].append((kind, s, m))
        self._refresh(g)
        consumer = self.executor_of.get((m, s + 1) if kind is F else (m, s - 1))
        if kind is not W and consumer is not None and consumer != g:
            self._refresh(consumer)


def compute_steps(
    stage_ranks: Sequence[Sequence[tuple[int, ...]]],
    microbatches: Sequence[int],
    schedule: str,
    virtual_stages: int = 1,
    executors: Mapping[tuple[int, int], int] | None = None,
) -> dict[tuple[int, int], list[list[Step]]]:
    """The compute order of every (replica, physical stage) group, in p2p steps.

    A step is a run of compute actions with no p2p batch between them ([Note: communication
    placement]); every schedule but interleaved 1F1B has one compute action per step.

    A group runs the micro-batches placed on it; migrated-in micro-batches are interleaved with
    its own by position within their owner (key: (index in owner, owner)), so every group sees
    any two micro-batches in the same relative order. With migrations, or for ZB-H1, the orders
    come from `_list_schedule` (a unit-cost execution, hence mutually consistent); otherwise
    from the textbook templates.

    Raises:
        ValueError: unknown schedule, or a schedule constraint is violated.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose one of {sorted(SCHEDULES)}")
    v = virtual_stages
    num_stages = len(stage_ranks[0])
    pp = num_stages // v
    executors = dict(executors or {})
    starts = [sum(microbatches[:d]) for d in range(len(microbatches))]
    owner = {starts[d] + i: (d, i) for d, n in enumerate(microbatches) for i in range(n)}
    if v > 1 and executors:
        raise ValueError("micro-batch migration is not supported with virtual stages")
    work: dict[tuple[int, int], list[int]] = {}
    for d in range(len(stage_ranks)):
        for s in range(pp):
            mine = [m for m in owner if executors.get((m, s), owner[m][0]) == d]
            work[(d, s)] = sorted(mine, key=lambda m: (owner[m][1], owner[m][0]))
    if schedule == "zb_h1" or executors:
        # Without migration the replicas are independent pipelines: schedule each on its own.
        parts = (
            [work]
            if executors
            else [{g: mbs for g, mbs in work.items() if g[0] == d} for d in range(len(stage_ranks))]
        )
        orders = {g: o for part in parts for g, o in _list_schedule(part, pp, schedule).items()}
        return {g: [[step] for step in order] for g, order in orders.items()}
    if schedule == "interleaved_1f1b":
        if v < 2:
            raise ValueError("interleaved_1f1b needs virtual_stages >= 2")
        return {g: _interleaved(mbs, g[1], pp, v) for g, mbs in work.items()}
    if v != 1:
        raise ValueError(f"{schedule} takes virtual_stages=1, got {v}")
    template: Callable[[Sequence[int], int, int], list[Step]] = (
        _gpipe if schedule == "gpipe" else _one_f_one_b
    )
    return {g: [[step] for step in template(mbs, g[1], pp)] for g, mbs in work.items()}


def compute_orders(
    stage_ranks: Sequence[Sequence[tuple[int, ...]]],
    microbatches: Sequence[int],
    schedule: str,
    virtual_stages: int = 1,
    executors: Mapping[tuple[int, int], int] | None = None,
) -> dict[tuple[int, int], list[Step]]:
    """`compute_steps` flattened: each group's compute actions in execution order."""
    steps = compute_steps(stage_ranks, microbatches, schedule, virtual_stages, executors)
    return {g: [c for step in group for c in step] for g, group in steps.items()}


def generate_actions(
    *,
    stage_ranks: Sequence[Sequence[tuple[int, ...]]],
    microbatches: Sequence[int],
    schedule: str,
    virtual_stages: int = 1,
    executors: Mapping[tuple[int, int], int] | None = None,
) -> dict[int, tuple[Action, ...]]:
    """Every rank's action list: compute, point-to-point batches, then REDUCE_GRAD, OPT_STEP.

    Args:
        stage_ranks: per replica, per virtual stage, the TP group's ranks.
        microbatches: micro-batches owned by each replica (global ids, see `plan`).
        schedule: one of `SCHEDULES`.
        virtual_stages: v (model chunks per device group).
        executors: (micro-batch, virtual stage) -> replica for migrated work.

    Returns:
        rank -> actions, placed as in [Note: communication placement].

    Raises:
        ValueError: unknown schedule or a violated schedule constraint.
    """
    executors = dict(executors or {})
    steps = compute_steps(stage_ranks, microbatches, schedule, virtual_stages, executors)
    num_stages = len(stage_ranks[0])
    links = _Links(stage_ranks, microbatches, executors)
    witness = _unit_times(steps, num_stages) if executors else None
    out: dict[int, tuple[Action, ...]] = {}
    for (d, s), group_steps in sorted(steps.items()):
        here = tuple(stage_ranks[d][s])
        posted_before = _recv_slots(group_steps, witness, num_stages)
        for rank in here:
            out[rank] = _rank_actions(group_steps, posted_before, links, here, rank)
    for rep in stage_ranks:  # ranks of groups with no work still reduce and step
        for group in rep:
            for rank in group:
                out.setdefault(rank, (Action(ActionKind.REDUCE_GRAD), Action(ActionKind.OPT_STEP)))
    return dict(sorted(out.items()))


class _Links:
    """The p2p actions a compute action needs around it: which TP group runs each
    (micro-batch, virtual stage), and the receives before / sends after a compute."""

    def __init__(
        self,
        stage_ranks: Sequence[Sequence[tuple[int, ...]]],
        microbatches: Sequence[int],
        executors: Mapping[tuple[int, int], int],
    ) -> None:
        self.stage_ranks, self.executors = stage_ranks, executors
        self.num_stages = len(stage_ranks[0])
        starts = [sum(microbatches[:d]) for d in range(len(microbatches))]
        self.owner = {starts[d] + i: d for d, n in enumerate(microbatches) for i in range(n)}

    def ranks_of(self, m: int, k: int) -> tuple[int, ...]:
        return tuple(self.stage_ranks[self.executors.get((m, k), self.owner[m])][k])

    def recvs(
        self, kind: ActionKind, k: int, m: int, here: tuple[int, ...], rank: int
    ) -> list[Action]:
        if kind is F and k > 0 and self.ranks_of(m, k - 1) != here:
            return _transfers(ActionKind.RECV_F, k, m, self.ranks_of(m, k - 1), here, rank)
        if kind is B and k < self.num_stages - 1 and self.ranks_of(m, k + 1) != here:
            return _transfers(ActionKind.RECV_B, k, m, self.ranks_of(m, k + 1), here, rank)
        return []

    def sends(
        self, kind: ActionKind, k: int, m: int, here: tuple[int, ...], rank: int
    ) -> list[Action]:
        if kind is F and k < self.num_stages - 1 and self.ranks_of(m, k + 1) != here:
            return _transfers(ActionKind.SEND_F, k, m, here, self.ranks_of(m, k + 1), rank)
        if kind is B and k > 0 and self.ranks_of(m, k - 1) != here:
            return _transfers(ActionKind.SEND_B, k, m, here, self.ranks_of(m, k - 1), rank)
        return []


def _rank_actions(
    group_steps: list[list[Step]],
    posted_before: list[list[Step]],
    links: _Links,
    here: tuple[int, ...],
    rank: int,
) -> tuple[Action, ...]:
    """One rank's list: each step's computes, with one p2p batch between steps (the previous
    step's sends, then the receives posted before this step), then REDUCE_GRAD and OPT_STEP."""
    acts: list[Action] = []
    pending: list[Action] = []
    for j, step in enumerate(group_steps):
        acts += pending  # one batch: the previous step's sends, these receives
        for kind, k, m in posted_before[j]:
            acts += links.recvs(kind, k, m, here, rank)
        pending = []
        for kind, k, m in step:
            acts.append(Action(kind, k, m))
            pending += links.sends(kind, k, m, here, rank)
    acts += pending
    acts += [Action(ActionKind.REDUCE_GRAD), Action(ActionKind.OPT_STEP)]
    return tuple(acts)


def _producer(step: Step, num_stages: int) -> Step | None:
    """The remote-able compute whose output `step` consumes (None for the first F / last B)."""
    kind, k, m = step
    if kind is F and k > 0:
        return (F, k - 1, m)
    if kind is B and k < num_stages - 1:
        return (B, k + 1, m)
    return None


def _unit_times(
    steps: Mapping[tuple[int, int], list[list[Step]]], num_stages: int
) -> dict[Step, int]:
    """Start time of every compute when each costs 1 and transfers are instant (the witness of
    [Note: migration placement])."""
    orders = {g: [c for step in group for c in step] for g, group in steps.items()}
    pos = dict.fromkeys(orders, 0)
    clock = dict.fromkeys(orders, 0)
    start: dict[Step, int] = {}
    left = sum(len(o) for o in orders.values())
    while left:
        progressed = False
        for g, order in orders.items():
            while pos[g] < len(order):
                kind, k, m = step = order[pos[g]]
                needs = [_producer(step, num_stages)]
                needs += [(F, k, m)] if kind is B else [(B, k, m)] if kind is W else []
                if any(n is not None and n not in start for n in needs):
                    break
                ready = max((start[n] + 1 for n in needs if n is not None), default=0)
                start[step] = max(clock[g], ready)
                clock[g] = start[step] + 1
                pos[g] += 1
                left -= 1
                progressed = True
        if not progressed:  # pragma: no cover - compute_steps never yields inconsistent orders
            raise RuntimeError("compute orders are mutually inconsistent")
    return start


def _recv_slots(
    group_steps: list[list[Step]], witness: dict[Step, int] | None, num_stages: int
) -> list[list[Step]]:
    """For each step, the computes whose inputs are received in the batch just before it."""
    if witness is None:
        return group_steps
    starts = [min(witness[c] for c in step) for step in group_steps]
    slots: list[list[Step]] = [[] for _ in group_steps]
    for step in group_steps:
        for c in step:
            producer = _producer(c, num_stages)
            if producer is not None:
                ready = witness[producer] + 1
                slots[next(j for j, t in enumerate(starts) if t >= ready)].append(c)
    return slots


def _transfers(
    kind: ActionKind, stage: int, mb: int, src: tuple[int, ...], dst: tuple[int, ...], rank: int
) -> list[Action]:
    """This rank's share of one message's chunks, as SEND (rank in src) or RECV (rank in dst)."""
    chunks = p2p_chunks(src, dst)
    n = len(chunks)
    if kind in (ActionKind.SEND_F, ActionKind.SEND_B):
        return [Action(kind, stage, mb, b, c, n) for c, a, b in chunks if a == rank]
    return [Action(kind, stage, mb, a, c, n) for c, a, b in chunks if b == rank]
