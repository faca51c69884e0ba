"""A harmless stand-in for `python -m unbroken.launch.trainer`, spawned by the agent in
tests/launch/test_agent.py with the trainer's arguments (`--spec --rank --heartbeat --reclaim
[--local-rank] [--shadow --attempt]`).

The spec is a JSON file: {"generation": G, "ranks": {"<rank>": {what this rank does}}}, with
  "iteration": the iteration its beats report (completed: the one before), default 0;
  "go": wait for SIGUSR1 (the test sends it once the agent has seen a beat) before going on;
  "then": "exit" (default) | "run" (beat until killed) | "stop" (SIGSTOP itself) |
          "sleep" (stop beating, sleep) | "reclaim" (ask for the shadows' memory, then exit
          with 10 + the number reclaimed);
  "say": a last line for its log; "exit": its exit status.
A shadow (`--shadow L`) reports SHADOW_READY at L for the spec's generation, waits for its
`Promote` on stdin and then does what the promoted spec says. Every process writes its pid to
`<spec's directory>/pids/` first, so the test can check that none is left behind.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from pathlib import Path

from unbroken.launch.heartbeat import Heartbeat
from unbroken.launch.inbox import ShadowInbox
from unbroken.shadow.client import ReclaimClient

BEAT_S = 0.1


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    for name in ("--spec", "--heartbeat", "--reclaim"):
        p.add_argument(name, required=True)
    for name in ("--rank", "--local-rank", "--shadow", "--attempt"):
        p.add_argument(name, type=int, default=0)
    return p.parse_args()


def _act(hb: Heartbeat, act: dict, args: argparse.Namespace, generation: int) -> int:
    then = act.get("then", "exit")
    if then == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    if then == "sleep":
        hb.stop()
    if then in ("run", "sleep", "stop"):
        threading.Event().wait()  # until killed
    if then == "reclaim":
        client = ReclaimClient(args.reclaim, args.rank, generation)
        answer = client.request("test allocation failure", used=0, total=1 << 40)
        return 10 + answer.reclaimed
    print(act.get("say", "done"), flush=True)
    return int(act.get("exit", 0))


def main() -> int:
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})  # before any beat: see "go"
    args = _args()
    spec = json.loads(Path(args.spec).read_text())
    pids = Path(args.spec).parent / "pids"
    pids.mkdir(exist_ok=True)
    (pids / str(os.getpid())).touch()
    hb = Heartbeat(args.heartbeat, args.rank, spec["generation"], BEAT_S)
    if args.shadow:
        hb.shadow_ready(args.shadow, {args.shadow: 1 << 20})
        hb.start()
        # The shadows' own inbox: it keeps nothing to map and warms nothing up.
        promote, _ = ShadowInbox(sys.stdin).await_promotion(lambda: None)
        spec = json.loads(Path(promote.spec).read_text())
        hb.promoted(spec["generation"])
    act = spec["ranks"][str(args.rank)]
    iteration = int(act.get("iteration", 0))
    hb.last_completed = iteration - 1
    hb("compute", iteration, 0, 1)
    hb.beat()
    if not args.shadow:  # a shadow's beats run since it started
        hb.start()
    if act.get("go"):
        signal.sigwait({signal.SIGUSR1})
    return _act(hb, act, args, spec["generation"])


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # as the trainer does: no interpreter teardown
