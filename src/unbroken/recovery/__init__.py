"""Recovery decisions: the coordinator's state machine (`fsm`) and the one decision of how a
generation obtains its state and where the job resumes (`decision`). Pure: no processes, no
collectives — `unbroken.launch` executes what these decide."""

from unbroken.recovery.decision import (
    RankAction,
    RankExit,
    RestoreDecision,
    RestoreMode,
    RestorePath,
    RetainedSummary,
    decide_restore,
    restore_mode,
)
from unbroken.recovery.fsm import (
    ALLOWED,
    FATAL_EXIT,
    Action,
    Fail,
    Finish,
    IllegalTransition,
    RecoveryMachine,
    RecoveryState,
    Start,
    Stop,
)

__all__ = [
    "ALLOWED",
    "FATAL_EXIT",
    "Action",
    "Fail",
    "Finish",
    "IllegalTransition",
    "RankAction",
    "RankExit",
    "RecoveryMachine",
    "RecoveryState",
    "RestoreDecision",
    "RestoreMode",
    "RestorePath",
    "RetainedSummary",
    "Start",
    "Stop",
    "decide_restore",
    "restore_mode",
]
