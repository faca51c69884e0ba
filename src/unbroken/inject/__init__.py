"""Fault injection: a catalog of fault kinds and a schedule keyed by (rank, iteration, phase)
or by wall time since the job started.

Spec syntax (config `inject = [...]`, CLI `--inject`, tests):
    KIND:rank=R,iter=I[,phase=P][,step=S]     e.g. kill:rank=1,iter=12,phase=update
    KIND:rank=R,at=SECONDS                    e.g. hang:rank=0,at=4.5
    slow:rank=R,iter=I,factor=F[,what=compute|comm]
                                              compute (default) or communication (the
                                              gradient all-reduce; a plan rank's p2p sends)
                                              slowed F× from iteration I on
    slow:rank=R,iter=I,level=weak|medium|severe[,what=...]
                                              the factor that costs ~35/55/70% throughput
    memspike:rank=R,iter=I,mb=M               M MiB more memory for iteration I
    lose:rank=R,iter=I[,phase=P]              the device of rank R (numbered as at launch) is
                                              gone for the rest of the job
    nodeloss:rank=R,iter=I[,phase=P]          the node that runs rank R dies at once (its
                                              agent and every process under it)
    flaky:rank=R,iter=I[,phase=P]             the device of rank R passes its health check but
                                              kills every trainer on it from iteration I on,
                                              generation after generation (a crash loop)
KIND ∈ kill (SIGKILL), hang (SIGSTOP), exception (raise), oom (a failed device allocation),
slow, pageloss, ckptcorrupt (damage the newest checkpoint on disk, then SIGKILL), memspike,
lose (a device lost for good, recorded in the job's device registry, `devices`) (see
`FaultKind`);
what a slow fault stretches and how: [Note: slow-fault] in `injector`. A fault fires once per job: the
firing is recorded in the job's store before the fault acts, so a redone iteration after
recovery runs clean — except `flaky`, whose device keeps failing (its repeats are logged as
`flaky_crash`, not as injected faults).
"""

from unbroken.devices import DeviceRegistry
from unbroken.inject.faults import (
    FaultKind,
    FaultSpec,
    InjectedFault,
    SlowTarget,
    faults_not_fired,
    parse_fault,
)
from unbroken.inject.injector import Injector

__all__ = [
    "DeviceRegistry",
    "FaultKind",
    "FaultSpec",
    "InjectedFault",
    "Injector",
    "SlowTarget",
    "faults_not_fired",
    "parse_fault",
]
