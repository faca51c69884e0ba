"""Fault injection: a catalog of fault kinds and a schedule keyed by (rank, iteration, phase)
or by wall time since the job started.

Spec syntax (config `inject = [...]`, CLI `--inject`, tests):
    KIND:rank=R,iter=I[,phase=P][,step=S]     e.g. kill:rank=1,iter=12,phase=update
    KIND:rank=R,at=SECONDS                    e.g. hang:rank=0,at=4.5
    slow:rank=R,iter=I,factor=F               compute slowed F× from iteration I on
KIND ∈ kill (SIGKILL), hang (SIGSTOP), exception (raise), slow. A fault fires once per job: the
firing is recorded in the job's store before the fault acts, so a redone iteration after
recovery runs clean.
"""

from unbroken.inject.faults import FaultKind, FaultSpec, InjectedFault, parse_fault
from unbroken.inject.injector import Injector

__all__ = ["FaultKind", "FaultSpec", "InjectedFault", "Injector", "parse_fault"]
