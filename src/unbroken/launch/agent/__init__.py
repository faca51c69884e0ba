"""The node agent: spawns and supervises this node's trainers, detects failures, executes the
coordinator's commands. It never touches training state.

Run as `python -m unbroken.launch.agent --coordinator HOST:PORT --node N`, with the job secret
in the environment variable UNBROKEN_JOB_SECRET.

A thin event loop over four parts, each owning one thing:

- `loop.Agent`: the event loop and the generation's trainers (commands in, decisions out);
- `supervisor.ProcessSupervisor`: spawns trainers, shadows and state managers (death with the
  agent, memory cgroup, niceness, logs, the fork server), kills and reaps them;
- `hang.HangDetector`: pure; from a trainer's spawn time, last beat, status and a CPU probe,
  decides hung vs starved vs fine;
- `shadows.ShadowPool`: the next generation's shadows (pending, live, ready, promoted,
  reclaimed, relaunched), and `reclaim.Reclaimer`: frees their memory when training needs it
  (the memory budget's controller, the device level policy).

Detection: a child that exits is noticed at once (its pidfd wakes the agent's loop; a child
that exits before its pidfd is open is found by the poll of the next tick, `TICK_S`); a child
whose heartbeats (`RankBeat` datagrams on the agent's Unix socket, sent by a trainer thread
every `heartbeat_interval_s`) stop for `heartbeat_timeout_s` is declared hung unless it is
still burning CPU (`hang`). Only decisions go to the coordinator (`RankExited`, `RankHung`),
never raw heartbeats.
"""

from unbroken.launch.agent.loop import TICK_S, Agent, main

__all__ = ["TICK_S", "Agent", "main"]
