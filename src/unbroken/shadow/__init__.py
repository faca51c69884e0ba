"""Shadow trainers (Leto §6): pre-initialized stand-ins that take over a rank on a failure.

- `forkserver`: shadows forked from a per-node server that has already done every import
  (level L1 at once).

The shadow's levels, its parking and promotion live in `unbroken.launch.trainer` (`--shadow L`);
the agent spawns and promotes shadows (`unbroken.launch.agent`). See docs/architecture.md.
"""

from unbroken.shadow.forkserver import ForkedProc, ShadowForkServer

__all__ = ["ForkedProc", "ShadowForkServer"]
