"""The trainer process of one rank: `python -m unbroken.launch.trainer --spec SPEC --rank R
--heartbeat ADDR --reclaim ADDR [--shadow L --attempt A] [--local-rank I]`.

SPEC is the JSON the coordinator writes for each generation (`GenerationSpec`); the process is
a `RankSession` (`unbroken.launch.session`). Exit status (`unbroken.recovery.RankExit`): 0 = all
iterations done; 3 (FALLBACK) = retained state beyond in-place repair (the coordinator falls
back to checkpoint-restart); anything else is a failure for the agent to report. A failure's
traceback is always written to the rank's log (the agent points stderr there), followed by a
one-line reason, which is the last line the agent reads back.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path

__all__ = ["TRAINER_IMPORTS", "main"]

TRAINER_IMPORTS = [
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch._inductor.config",  # torch.use_deterministic_algorithms imports it (0.7 s)
    "unbroken.checkpoint",
    "unbroken.checkpoint.interval",
    "unbroken.checkpoint.policy",
    "unbroken.config",
    "unbroken.data",
    "unbroken.detect.timing",
    "unbroken.inject",
    "unbroken.jobstore",
    "unbroken.launch.executor",
    "unbroken.launch.heartbeat",
    "unbroken.launch.loop",
    "unbroken.launch.restore",
    "unbroken.launch.retained",
    "unbroken.launch.session",
    "unbroken.messages",
    "unbroken.metrics.log",
    "unbroken.recovery",
    "unbroken.state.client",
    "unbroken.train",
    "unbroken.engine.replica",
    "unbroken.train.tail",
    "unbroken.update",
    "unbroken.update.rmu",
    "unbroken.launch.trainer",
]
"""Every module a trainer imports: what level L1 has done (the shadow fork server preloads
these; see unbroken.shadow.forkserver)."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="unbroken-trainer")
    parser.add_argument("--spec", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--heartbeat", default=None, help="the agent's heartbeat socket")
    parser.add_argument("--reclaim", default=None, help="the agent's reclamation socket")
    parser.add_argument(
        "--shadow", type=int, default=0, choices=(0, 1, 2, 3), help="pre-initialize to this level"
    )
    parser.add_argument(
        "--attempt", type=int, default=0, help="shadows: which set for this generation"
    )
    parser.add_argument(
        "--local-rank",
        type=int,
        default=None,
        help="this rank's index on its node: its GPU is cuda:(local-rank %% device count)",
    )
    args = parser.parse_args(argv)
    if args.local_rank is not None:
        os.environ["LOCAL_RANK"] = str(args.local_rank)
    from unbroken.launch.session import RankArgs, RankSession
    from unbroken.launch.spec import GenerationSpec

    spec = GenerationSpec.from_json(Path(args.spec).read_text())
    session = RankSession(
        spec,
        RankArgs(
            rank=args.rank,
            heartbeat=args.heartbeat,
            reclaim=args.reclaim,
            shadow=args.shadow,
            attempt=args.attempt,
        ),
    )
    try:
        code = session.run()
        # Everything this process reports is already written with unbuffered os.write; skip the
        # interpreter and gloo teardown (0.8-1.8 s measured) that would only delay the exit.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(int(code))
    except Exception as exc:  # the agent reports the exit; the log keeps why
        from unbroken.errors import UserError

        kind = "error" if isinstance(exc, UserError) else type(exc).__name__
        traceback.print_exc(file=sys.stderr)  # always in the rank's log
        print(
            f"unbroken-trainer[rank {session.rank}] in {session.doing}: {kind}: {exc}",
            file=sys.stderr,
        )
        sys.stderr.flush()
        os._exit(1)  # exit now: a failed rank must be noticed without waiting for teardown


if __name__ == "__main__":
    raise SystemExit(main())
