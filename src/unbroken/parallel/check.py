"""Static checks of a plan's action lists: matching sends and receives, FIFO order, data deps.

Owns the rules that decide whether a set of action lists is *coherent* before anything is
timed: every SEND has exactly one RECV on its peer and vice versa (`transfer_key`), messages on
one directed link are received in the order they are sent (NCCL matches p2p operations in
order), and each compute action comes after what it consumes on its own rank. The simulator runs
these checks first and reports their findings together with the actions a timed run leaves stuck.

Never imports torch; pure functions of a plan.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from unbroken.parallel.actions import COMM_KINDS, Action, ActionKind

__all__ = ["Problem", "check_plan", "match_transfers", "pair_transfers", "transfer_key"]

TransferKey = tuple[int, int, str, int, int, int, int]
Ref = tuple[int, int]
"""(rank, index of the action in the rank's list)."""
_SENDS = frozenset({ActionKind.SEND_F, ActionKind.SEND_B})


@dataclass(frozen=True, slots=True)
class Problem:
    """One thing wrong with an action list, pointing at the offending action."""

    rank: int
    index: int
    """Position of the action in the rank's list."""
    action: Action
    reason: str

    def __str__(self) -> str:
        return f"r{self.rank}[{self.index}] {self.action}: {self.reason}"


def transfer_key(rank: int, action: Action) -> TransferKey:
    """The identity a SEND and its RECV share ([Note: send/recv stage indices] in `actions`).

    Returns:
        (src rank, dst rank, "F"|"B", receiving virtual stage, micro-batch, chunk, num_chunks).
    """
    assert action.peer is not None and action.stage is not None and action.microbatch is not None
    kind = action.kind
    if kind is ActionKind.SEND_F:
        return (
            rank,
            action.peer,
            "F",
            action.stage + 1,
            action.microbatch,
            action.chunk,
            action.num_chunks,
        )
    if kind is ActionKind.SEND_B:
        return (
            rank,
            action.peer,
            "B",
            action.stage - 1,
            action.microbatch,
            action.chunk,
            action.num_chunks,
        )
    direction = "F" if kind is ActionKind.RECV_F else "B"
    return (
        action.peer,
        rank,
        direction,
        action.stage,
        action.microbatch,
        action.chunk,
        action.num_chunks,
    )


def match_transfers(
    actions: dict[int, tuple[Action, ...]] | object,
) -> tuple[dict[tuple[int, int], tuple[int, int]], list[Problem]]:
    """Pair every SEND with its RECV by `transfer_key` and check FIFO order per link.

    Args:
        actions: rank -> action list (a plan's `actions`).

    Returns:
        (partner map (rank, index) -> (rank, index) in both directions, problems found).
    """
    sends, recvs = _comm_by_key(actions)
    partner, problems = _pair_by_key(actions, sends, recvs)
    problems += _fifo_problems(actions, partner)
    return partner, problems


def pair_transfers(actions) -> dict[Ref, Ref]:
    """The partner map of `match_transfers` alone (the first SEND and the first RECV of each
    `transfer_key` paired, both directions), without its problem checks: one pass, for callers
    that replay lists many times (the simulator reports what stays stuck itself)."""
    sends: dict[TransferKey, Ref] = {}
    recvs: dict[TransferKey, Ref] = {}
    for rank, acts in actions.items():
        for i, a in enumerate(acts):
            if a.kind in COMM_KINDS:
                (sends if a.kind in _SENDS else recvs).setdefault(transfer_key(rank, a), (rank, i))
    partner: dict[Ref, Ref] = {}
    for key, s in sends.items():
        r = recvs.get(key)
        if r is not None:
            partner[s], partner[r] = r, s
    return partner


def _problem(actions, ref: Ref, reason: str) -> Problem:
    return Problem(ref[0], ref[1], actions[ref[0]][ref[1]], reason)


def _comm_by_key(actions) -> tuple[dict[TransferKey, list[Ref]], dict[TransferKey, list[Ref]]]:
    """Every SEND and every RECV, grouped by `transfer_key`, in rank and list order."""
    sends: dict[TransferKey, list[Ref]] = defaultdict(list)
    recvs: dict[TransferKey, list[Ref]] = defaultdict(list)
    for rank, acts in actions.items():
        for i, a in enumerate(acts):
            if a.is_comm:
                (sends if a.is_send else recvs)[transfer_key(rank, a)].append((rank, i))
    return sends, recvs


def _pair_by_key(
    actions, sends: dict[TransferKey, list[Ref]], recvs: dict[TransferKey, list[Ref]]
) -> tuple[dict[Ref, Ref], list[Problem]]:
    """The first SEND and RECV of each key paired (both directions); duplicates and unmatched
    ends reported."""
    problems: list[Problem] = []
    partner: dict[Ref, Ref] = {}
    for key in sorted(set(sends) | set(recvs)):
        s, r = sends.get(key, []), recvs.get(key, [])
        for extra in s[1:]:
            problems.append(_problem(actions, extra, "duplicate send of the same message"))
        for extra in r[1:]:
            problems.append(_problem(actions, extra, "duplicate receive of the same message"))
        if s and r:
            partner[s[0]], partner[r[0]] = r[0], s[0]
        elif s:
            problems.append(_problem(actions, s[0], f"SEND with no matching RECV on r{key[1]}"))
        else:
            problems.append(_problem(actions, r[0], f"RECV with no matching SEND on r{key[0]}"))
    return partner, problems


def _fifo_problems(actions, partner: dict[Ref, Ref]) -> list[Problem]:
    """FIFO per directed link: the j-th send on src->dst must pair with the j-th receive; the
    first misordered receive of each link is reported."""
    link_sends: dict[tuple[int, int], list[Ref]] = defaultdict(list)
    link_recvs: dict[tuple[int, int], list[Ref]] = defaultdict(list)
    for rank, acts in actions.items():
        for i, a in enumerate(acts):
            if a.is_comm and (rank, i) in partner:
                key = transfer_key(rank, a)
                (link_sends if a.is_send else link_recvs)[key[:2]].append((rank, i))
    problems = []
    for link, sent in link_sends.items():
        received = link_recvs[link]
        for j, (snd, rcv) in enumerate(zip(sent, received, strict=True)):
            if partner[snd] != rcv:
                want = actions[snd[0]][snd[1]]
                problems.append(
                    _problem(
                        actions,
                        rcv,
                        f"misordered: receive #{j} from r{link[0]} but send #{j} on that link "
                        f"is {want}",
                    )
                )
                break
    return problems


def _dependency_problems(rank: int, acts: tuple[Action, ...], last_stage: int) -> list[Problem]:
    done: set[tuple[str, int, int]] = set()
    problems = []
    for i, a in enumerate(acts):
        if a.stage is None:
            continue
        k, m = a.stage, a.microbatch
        assert m is not None
        need: list[tuple[str, int, int]] = []
        if a.kind is ActionKind.F and k > 0:
            need = [("F", k - 1, m), ("RECV_F", k, m)]
        elif a.kind is ActionKind.B:
            if ("F", k, m) not in done:
                problems.append(Problem(rank, i, a, f"B before its F ({k}F{m}) on this rank"))
            if k < last_stage:
                need = [("B", k + 1, m), ("RECV_B", k, m)]
        elif a.kind is ActionKind.W:
            need = [("B", k, m)]
        elif a.kind is ActionKind.SEND_F:
            need = [("F", k, m)]
        elif a.kind is ActionKind.SEND_B:
            need = [("B", k, m)]
        if need and not any(n in done for n in need):
            problems.append(
                Problem(rank, i, a, f"runs before its input ({' or '.join(map(_fmt, need))})")
            )
        done.add((str(a.kind), k, m))
    return problems


def _fmt(need: tuple[str, int, int]) -> str:
    return f"{need[1]}{need[0]}{need[2]}"


def check_plan(plan: object) -> list[Problem]:
    """All static problems of a plan's action lists (empty when coherent).

    Checks transfer matching and FIFO order (`match_transfers`), that each compute action
    follows its input on the same rank (an F after the previous stage's F or a RECV_F, a B after
    its F and the next stage's B or a RECV_B, a W after its B, a SEND after what it sends), and
    that every (micro-batch, virtual stage) gets an F and a B on each rank of its executing group.

    Args:
        plan: a `ParallelPlan`.

    Returns:
        The problems, in rank order.
    """
    actions = plan.actions  # type: ignore[attr-defined]
    _, problems = match_transfers(actions)
    last = plan.num_stages - 1  # type: ignore[attr-defined]
    for rank, acts in actions.items():
        problems += _dependency_problems(rank, acts, last)
    present = {rank: set(acts) for rank, acts in actions.items()}
    for (mb, k), d in plan.placement().items():  # type: ignore[attr-defined]
        for rank in plan.replicas[d].stages[k].ranks:  # type: ignore[attr-defined]
            acts = actions[rank]
            for kind in (ActionKind.F, ActionKind.B):
                if Action(kind, k, mb) not in present[rank]:
                    problems.append(
                        Problem(
                            rank, len(acts), Action(kind, k, mb), "missing: never executed here"
                        )
                    )
    return sorted(problems, key=lambda p: (p.rank, p.index))
