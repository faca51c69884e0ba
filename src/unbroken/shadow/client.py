"""Trainer side of reclamation on an allocation failure (Leto §6, "OOM callback").

When the active trainer's device allocator reports an OOM (`torch.OutOfMemoryError`), the
trainer asks its node agent to reclaim the shadows' memory and waits until the agent answers
that they are gone; then it retries. On a CPU node under a memory budget the kernel plays the
allocator's part (`unbroken.shadow.memory`); this path is for allocators that fail instead of
waiting — CUDA's caching allocator, or an injected `oom` fault.

Request and answer are typed datagrams (`unbroken.messages.ReclaimRequest` / `ReclaimAnswer`)
on the agent's reclamation socket (not its heartbeat socket); the trainer binds its own abstract
address for the answer. Whether a retry is safe is the trainer's call: only an allocation
failure before the gradient all-reduce (forward/backward) — the model state is untouched there,
the iteration is simply computed again with the same inputs.
"""

from __future__ import annotations

import os
import socket
import time

from unbroken.messages import ReclaimAnswer, ReclaimRequest, decode_json, encode_json

__all__ = ["ReclaimClient"]


def _addr(text: str) -> str:
    return text.replace("@", "\0", 1) if text.startswith("@") else text


class ReclaimClient:
    def __init__(self, agent_addr: str, rank: int, generation: int, timeout_s: float = 30.0):
        self.agent_addr = _addr(agent_addr)
        self.rank = rank
        self.generation = generation
        self.timeout_s = timeout_s
        self._reply_name = f"@unbroken-reclaim-{os.getpid()}-{os.urandom(4).hex()}"
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(_addr(self._reply_name))

    def request(
        self,
        reason: str,
        used: int | None = None,
        total: int | None = None,
        iteration: int | None = None,
    ) -> ReclaimAnswer:
        """Ask for the shadows' memory; returns the agent's answer. `iteration` is the one
        being retried: the agent relaunches shadows only once this trainer has got past it.

        Raises:
            TimeoutError: the agent did not answer in `timeout_s`.
        """
        msg = ReclaimRequest(
            rank=self.rank,
            generation=self.generation,
            reply=self._reply_name,
            reason=reason,
            t=time.time(),
            iteration=iteration,
            used=used,
            total=total,
        )
        self._sock.sendto(encode_json(msg), self.agent_addr)
        self._sock.settimeout(self.timeout_s)
        try:
            data = self._sock.recv(65536)
        except TimeoutError:
            raise TimeoutError(
                f"the agent did not answer a reclamation request in {self.timeout_s} s"
            ) from None
        answer = decode_json(data, (ReclaimAnswer,))
        assert isinstance(answer, ReclaimAnswer)
        return answer
