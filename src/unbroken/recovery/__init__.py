"""The recovery state machine: classify a failure, choose the recovery, drive it to completion.

States and transitions are explicit (`RecoveryState`); every transition is logged as a
`state` event with the reason. The coordinator feeds it agent decisions and executes its
actions; the machine itself does no I/O.
"""

from unbroken.recovery.fsm import FATAL_EXIT, Action, RecoveryMachine, RecoveryState

__all__ = ["FATAL_EXIT", "Action", "RecoveryMachine", "RecoveryState"]
