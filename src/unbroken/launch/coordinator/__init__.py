"""The coordinator of a run (one per job): a control server for the node agents, a core that
holds the recovery state machine and executes its actions, and a run monitor that watches the
run's logs. See `run.Coordinator`."""

from unbroken.launch.coordinator.core import CoordinatorCore
from unbroken.launch.coordinator.monitor import RunMonitor
from unbroken.launch.coordinator.nodes import Endpoints, NodeLayout, NodeSpec
from unbroken.launch.coordinator.run import Coordinator, RunOutcome
from unbroken.launch.coordinator.server import ControlServer

__all__ = [
    "ControlServer",
    "Coordinator",
    "CoordinatorCore",
    "Endpoints",
    "NodeLayout",
    "NodeSpec",
    "RunMonitor",
    "RunOutcome",
]
