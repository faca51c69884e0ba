"""The job's key-value store, typed: every key the processes of a job share, in one place.

The store itself is torch.distributed's `TCPStore`, hosted by the coordinator (never by a
trainer, so a dead trainer cannot take it along) and shared by every generation of trainers.
Process groups rendezvous under a prefix per generation (`generation_store`); everything else a
job shares through the store is one of the typed entries below:

    job/t0                 wall time the job's first trainer started (fault `at=` triggers)
    ckpt/cost_s            the measured cost of one checkpoint (Young's interval)
    ckpt/interval          the checkpoint interval, decided once (by rank 0) for the whole job
    inject/<fault key>     wall time a scheduled fault fired (each fires once per job)
    plan/epoch             the newest placement the coordinator published (0: none)
    plan/<epoch>           that placement, as JSON (`unbroken.parallel.DataPlacement`); only
                           the newest `PLANS_KEPT` epochs stay

Reading an entry another process has not written yet returns None, except where a method
says it waits (`job_t0`, `wait_checkpoint_interval`). A placement is written before its epoch,
so whoever reads an epoch finds its placement. The
store has no authentication; it listens on the job's address only (docs/security.md).
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch.distributed as dist

__all__ = ["PLANS_KEPT", "JobStore", "RendezvousStore"]

_T0 = "job/t0"
_CKPT_COST = "ckpt/cost_s"
_CKPT_INTERVAL = "ckpt/interval"
_FAULT = "inject/"
_PLAN_EPOCH = "plan/epoch"
_PLAN = "plan/"
PLANS_KEPT = 3
"""Placements kept in the store: the newest and the two before it. A rank reads the epoch's
placement right after rank 0 broadcast the epoch (`unbroken.launch.switch`); one older
than that is read by no one. Kept all, they grew the store by one key per re-plan (the
two-node soak: 3 -> 9 keys over 11 recoveries, four of them re-plans)."""


class JobStore:
    """Typed access to a job's store.

    Args:
        store: the job's `TCPStore` (or any `dist.Store`, e.g. a `HashStore` in tests).
    """

    def __init__(self, store: dist.Store) -> None:
        self.raw = store
        self._listener: socket.socket | None = None

    @classmethod
    def host(cls, host: str, timeout_s: float, port: int = 0) -> JobStore:
        """Start the job's store server (the coordinator does, once per run), listening on
        `host` only: torch's TCPStore, left to itself, listens on every interface whatever
        host it is given — the socket is bound here and handed to it (`master_listen_fd`)."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = socket.create_server((host.strip("[]"), port), family=family, backlog=1024)
        store = dist.TCPStore(
            host,
            listener.getsockname()[1],
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=timeout_s),
            master_listen_fd=listener.fileno(),
        )
        job = cls(store)
        job._listener = listener  # the server's socket lives as long as the store
        return job

    @classmethod
    def connect(cls, host: str, port: int, timeout_s: float) -> JobStore:
        """Connect to the job's store from a trainer."""
        store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
        return cls(store)

    @property
    def port(self) -> int:
        return self.raw.port

    def generation_store(
        self, generation: int, shadow_attempt: int | None = None
    ) -> RendezvousStore:
        """The prefix under which generation `generation`'s process group rendezvouses. A set of
        shadows (attempt a) rendezvouses under its own, so fresh processes started instead of
        them never meet their keys. The keys this process writes there are recorded, so it can
        delete them once its group is formed (`RendezvousStore.forget`)."""
        prefix = f"gen{generation}" + ("" if shadow_attempt is None else f"-shadow{shadow_attempt}")
        return RendezvousStore(dist.PrefixStore(prefix, self.raw))

    def num_keys(self) -> int:
        return self.raw.num_keys()

    def _get(self, key: str) -> str | None:
        if not self.raw.check([key]):
            return None
        return self.raw.get(key).decode()

    # -- job ------------------------------------------------------------------------------
    def job_t0(self, now: float | None = None) -> float:
        """The job's start time; the first caller passing `now` sets it (rank 0 does)."""
        if now is not None and not self.raw.check([_T0]):
            self.raw.set(_T0, repr(now))
        return float(self.raw.get(_T0).decode())  # blocks until rank 0 has set it

    # -- checkpoints ----------------------------------------------------------------------
    def checkpoint_cost(self) -> float | None:
        value = self._get(_CKPT_COST)
        return None if value is None else float(value)

    def set_checkpoint_cost(self, seconds: float) -> None:
        self.raw.set(_CKPT_COST, repr(seconds))

    def checkpoint_interval(self) -> int | None:
        value = self._get(_CKPT_INTERVAL)
        return None if value is None else int(value)

    def wait_checkpoint_interval(self) -> int:
        """The interval, waiting (up to the store's timeout) until rank 0 has decided it."""
        return int(self.raw.get(_CKPT_INTERVAL).decode())

    def set_checkpoint_interval(self, iterations: int) -> None:
        self.raw.set(_CKPT_INTERVAL, str(iterations))

    # -- fault injection ------------------------------------------------------------------
    def fault_fired(self, key: str) -> bool:
        return self.raw.check([_FAULT + key])

    def fault_fired_at(self, key: str) -> float | None:
        """When the scheduled fault `key` fired (None: not yet)."""
        value = self._get(_FAULT + key)
        return None if value is None else float(value)

    def mark_fault_fired(self, key: str, t: float) -> None:
        self.raw.set(_FAULT + key, repr(t))

    # -- live reconfiguration -----------------------------------------------------------------
    def placement_epoch(self) -> int:
        """The newest placement's epoch (0: none published)."""
        value = self._get(_PLAN_EPOCH)
        return 0 if value is None else int(value)

    def placement(self, epoch: int) -> str | None:
        """The JSON of placement `epoch` (None: not published)."""
        return self._get(f"{_PLAN}{epoch}")

    def publish_placement(self, epoch: int, placement_json: str) -> None:
        """Publish placement `epoch` (the coordinator does; epochs only grow): the placement
        first, then the epoch that points to it."""
        self.raw.set(f"{_PLAN}{epoch}", placement_json)
        self.raw.set(_PLAN_EPOCH, str(epoch))
        old = epoch - PLANS_KEPT
        if old >= 1:
            self.raw.delete_key(f"{_PLAN}{old}")


class RendezvousStore(dist.Store):
    """A generation's rendezvous prefix that remembers the keys this process wrote.

    Every generation (and every set of shadows) forms its process group under a prefix of its
    own; the keys it writes there (each rank's address for gloo, the NCCL unique id) are read
    once, while the group forms. Left in place they pile up with every recovery (the soak
    measured 5.7 keys per recovery). Once the group is formed and every rank is past it (a
    barrier), each rank deletes what it wrote (`forget`) and the store stays the same size over
    a job's life. The store interface is delegated as is; torch calls it from C++.
    """

    def __init__(self, inner: dist.Store) -> None:
        super().__init__()
        self.inner = inner
        self.written: set[str] = set()

    def set(self, key: str, value) -> None:
        self.written.add(key)
        self.inner.set(key, value)

    def add(self, key: str, amount: int) -> int:
        self.written.add(key)
        return self.inner.add(key, amount)

    def compare_set(self, key: str, expected, desired) -> bytes:
        self.written.add(key)
        return self.inner.compare_set(key, expected, desired)

    def append(self, key: str, value) -> None:
        self.written.add(key)
        self.inner.append(key, value)

    def get(self, key: str) -> bytes:
        return self.inner.get(key)

    def wait(self, keys, *timeout) -> None:
        self.inner.wait(keys, *timeout)

    def check(self, keys) -> bool:
        return self.inner.check(keys)

    def delete_key(self, key: str) -> bool:
        self.written.discard(key)
        return self.inner.delete_key(key)

    def num_keys(self) -> int:
        return self.inner.num_keys()

    def set_timeout(self, timeout: timedelta) -> None:
        self.inner.set_timeout(timeout)

    @property
    def timeout(self) -> timedelta:
        return self.inner.timeout

    def forget(self) -> int:
        """Delete every key this process wrote here (call once every rank of the group has
        formed it); returns how many."""
        keys = sorted(self.written)
        for key in keys:
            self.inner.delete_key(key)
        self.written.clear()
        return len(keys)
