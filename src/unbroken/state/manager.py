"""The state-manager process: one per rank, owns that rank's retained memory.

Run as ``python -m unbroken.state.manager --socket PATH [--rank R]``. It serves the
`unbroken.state._wire` protocol on a Unix stream socket at PATH (0600, created atomically by
bind-to-temp + rename, so a path that exists is ready to connect) and keeps a `RetainedPool`:

==========  ============================================  =========================================
op          request fields                                reply fields (+ fd via SCM_RIGHTS)
==========  ============================================  =========================================
allocate    name, nbytes, page_bytes, protected,         name, nbytes, page_bytes, protected,
            device (optional: CUDA ordinal),              device, serial, fresh, missing (GPU)
            replace (optional: remake on a new geometry)
                                                          + fd (host regions: the memfd)
attach      name                                          same as allocate (fresh False) + fd
export      name, pages (GPU regions, <= 250)             ms + one exported fd per page, in order
list        —                                             regions: [{name, nbytes, ...}]
localize    names (optional list)                         lost: {name: [page, ...]}, ms
remap       name, pages                                   ms (GPU: then `export` the pages)
discard     name, pages (GPU regions)                     — (the pool's allocations dropped)
free        name                                          —
shutdown    —                                             — (then the manager exits)
==========  ============================================  =========================================

Every request may carry ``generation`` (the job's trainer generation of the client). The
manager keeps the highest it has served and refuses a request from an older one ("stale
generation"): a trainer of a generation being torn down (a hung one that wakes up, one on a
node partitioned away and back) cannot allocate, remap or free what its successor now uses.
Requests without one (the agent, tools) are served as before.

GPU regions (``device`` given) are CUDA virtual-memory allocations, one per page, whose handles
the pool holds (`unbroken.state.cuda_vmm`); the manager only calls `cuInit`, never creates a
context. A client fetches a GPU region's pages with `export`, a batch at a time: the manager
exports them as fds, sends them and closes its copies, so it holds no fd per page (a whole
GPU's memory fits under the open-file limit).

What it must never do: read or write page contents (it holds fds, truncates, seeks holes,
punches, fallocates, asks the kernel to populate page tables); crash on a bad request (a
malformed frame gets ``{"ok": false, "error": ...}``); serve a peer of another uid (checked
with `SO_PEERCRED` on every connection; logged and closed); outlive its parent (it polls
`os.getppid()` — not `PR_SET_PDEATHSIG`, which fires when the spawning *thread* exits and would
throw away retained state when an agent spawns from a worker thread).

Localization (`unbroken.state.localize`): memfd holes via `SEEK_HOLE` always; in addition an
madvise(MADV_POPULATE_READ) scan with bisection on EHWPOISON where the kernel has
``CONFIG_MEMORY_FAILURE`` (probed once at start). On the CI kernel MADV_HWPOISON is EINVAL, so
only the hole scan runs there and page loss is injected by punching holes
(`unbroken.state.pageloss`).

Single-threaded `selectors` loop: requests are short (localize ≈ 7 ms per GiB), and one thread
means no locking around the pool.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import selectors
import signal
import socket
import stat
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, ClassVar

from unbroken.state._syscalls import peer_credentials
from unbroken.state._wire import FrameError, FrameReader, send_frame
from unbroken.state.pool import PoolError, Region, RetainedPool

__all__ = ["StateManager", "main"]

log = logging.getLogger("unbroken.state.manager")

#: Seconds between parent-liveness checks (and the longest a shutdown waits for the loop).
PARENT_POLL_S = 0.2
#: A client that does not drain a reply within this many seconds is dropped.
SEND_TIMEOUT_S = 5.0


class StateManager:
    """Serve one rank's `RetainedPool` on a Unix socket.

    Args:
        socket_path: where to listen.
        rank: rank number, for logs and memfd names.
        parent_pid: exit when `os.getppid()` stops being this; None: the parent at start.
    """

    def __init__(
        self,
        socket_path: str | Path,
        rank: int = 0,
        parent_pid: int | None = None,
        fd_budget: int | None = None,
    ):
        self.socket_path = Path(socket_path)
        self.rank = rank
        self.parent_pid = os.getppid() if parent_pid is None else parent_pid
        self.uid = os.getuid()
        self.pool = RetainedPool(label=f"unbroken-rank{rank}", fd_budget=fd_budget)
        self._close_after_send: list[int] = []
        """Fds made for the reply being sent (an `export` past the pool's fd budget)."""
        self._selector = selectors.DefaultSelector()
        self._readers: dict[socket.socket, FrameReader] = {}
        self._listener: socket.socket | None = None
        self._running = False
        self._wakeup: tuple[socket.socket, socket.socket] | None = None
        self.generation = -1
        """The newest client generation served (older ones are refused as stale)."""

    def bind(self) -> None:
        """Create the listening socket (parent dir, stale-file removal, 0600, atomic rename).

        Raises:
            RuntimeError: another manager is already serving `socket_path`.
        """
        path = self.socket_path
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists() or path.is_symlink():
            if _is_live_socket(path):
                raise RuntimeError(f"another state manager is serving {path}")
            path.unlink()
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)
        try:
            listener.bind(str(tmp))
        finally:
            os.umask(old_umask)
        os.chmod(tmp, 0o600)
        listener.listen(64)
        os.rename(tmp, path)
        listener.setblocking(False)
        self._listener = listener
        self._selector.register(listener, selectors.EVENT_READ)
        log.info(
            "rank %d: serving %s (poison detection: %s)",
            self.rank,
            path,
            "madvise" if self.pool.detect_poison else "off, SEEK_HOLE only",
        )

    def serve_forever(self) -> None:
        """Serve until `shutdown`, `stop()`, or the parent's death; then clean up."""
        if self._listener is None:
            self.bind()
        self._running = True
        try:
            while self._running:
                for key, _events in self._selector.select(timeout=PARENT_POLL_S):
                    if key.data == "wakeup":
                        key.fileobj.recv(4096)  # type: ignore[union-attr]
                    elif key.fileobj is self._listener:
                        self._accept()
                    else:
                        self._service(key.fileobj)  # type: ignore[arg-type]
                if os.getppid() != self.parent_pid:
                    log.warning("rank %d: parent %d is gone; exiting", self.rank, self.parent_pid)
                    break
        finally:
            self._close()

    def stop(self) -> None:
        """Make `serve_forever` return after the current iteration (signal-safe)."""
        self._running = False

    def stop_on_signals(self, *signals: signal.Signals) -> None:
        """Stop promptly on `signals`: a wakeup fd in the selector interrupts the wait."""
        wake_r, wake_w = socket.socketpair()
        wake_r.setblocking(False)
        wake_w.setblocking(False)
        signal.set_wakeup_fd(wake_w.fileno(), warn_on_full_buffer=False)
        self._selector.register(wake_r, selectors.EVENT_READ, data="wakeup")
        self._wakeup = (wake_r, wake_w)
        for sig in signals:
            signal.signal(sig, lambda *_: self.stop())

    def _accept(self) -> None:
        assert self._listener is not None
        try:
            conn, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:  # e.g. EMFILE: refuse this client, keep the state
            log.error("rank %d: accept failed: %s", self.rank, exc)
            return
        try:
            cred = peer_credentials(conn)
        except OSError as exc:
            log.warning("rank %d: rejected a client without credentials: %s", self.rank, exc)
            conn.close()
            return
        if cred.uid != self.uid:
            log.warning(
                "rank %d: rejected pid %d: uid %d is not the manager's uid %d",
                self.rank,
                cred.pid,
                cred.uid,
                self.uid,
            )
            with contextlib.suppress(OSError):
                conn.setblocking(False)
                send_frame(conn, _error(f"uid {cred.uid} may not use this state manager"))
            conn.close()
            return
        conn.settimeout(SEND_TIMEOUT_S)
        self._readers[conn] = FrameReader()
        self._selector.register(conn, selectors.EVENT_READ)
        log.debug("rank %d: client pid %d connected", self.rank, cred.pid)

    def _service(self, conn: socket.socket) -> None:
        reader = self._readers[conn]
        try:
            data = conn.recv(65536)
            if not data:
                self._drop(conn, None)
                return
            frames = reader.feed(data)
        except FrameError as exc:
            with contextlib.suppress(OSError):
                send_frame(conn, _error(str(exc)))
            self._drop(conn, str(exc))
            return
        except OSError as exc:
            self._drop(conn, f"recv failed: {exc}")
            return
        for frame in frames:
            reply, fds = self._handle(frame)
            try:
                send_frame(conn, reply, fds)
            except OSError as exc:
                self._drop(conn, f"send failed: {exc}")
                return
            finally:
                for fd in self._close_after_send:  # fds made for this reply only
                    os.close(fd)
                self._close_after_send = []
            if not self._running:
                return

    def _handle(self, frame: dict[str, Any] | FrameError) -> tuple[dict[str, Any], list[int]]:
        if isinstance(frame, FrameError):
            return _error(str(frame)), []
        op = frame.get("op")
        serve = self._OPS.get(op) if isinstance(op, str) else None
        if serve is None:
            return _error(f"unknown op {op!r}"), []
        generation = frame.get("generation")
        if isinstance(generation, int) and not isinstance(generation, bool):
            if generation < self.generation:
                log.warning(
                    "rank %d: refused %s of stale generation %d (serving %d)",
                    self.rank,
                    op,
                    generation,
                    self.generation,
                )
                return _error(
                    f"stale generation {generation}: generation {self.generation} holds this state"
                ), []
            self.generation = generation
        try:
            return serve(self, frame)
        except PoolError as exc:
            return _error(str(exc)), []
        except OSError as exc:
            log.error("rank %d: %s failed: %s", self.rank, op, exc)
            return _error(f"{op} failed: {exc}"), []
        except Exception as exc:
            # A bug must not take the retained state down with the manager: log it loudly
            # (with its traceback) and refuse only this request.
            log.exception("rank %d: internal error serving %r", self.rank, op)
            return _error(f"internal error in {op}: {exc!r}"), []

    # One method per op of the protocol (the table in the module docstring); each returns the
    # reply and the fds to pass with it. Errors are turned into replies by `_handle`.

    def _op_allocate(self, frame: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        region, fresh = self.pool.allocate(
            frame.get("name"),
            frame.get("nbytes"),
            frame.get("page_bytes"),
            frame.get("protected", True),
            frame.get("device"),
            frame.get("replace", False),
        )
        return _region_reply(region, fresh), region.fds()

    def _op_attach(self, frame: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        region = self.pool.get(frame.get("name"))
        return _region_reply(region, False), region.fds()

    def _op_list(self, frame: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        return {"ok": True, "regions": [r.describe() for r in self.pool.regions()]}, []

    def _op_localize(self, frame: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        names = frame.get("names")
        if names is not None and not (
            isinstance(names, list) and all(isinstance(n, str) for n in names)
        ):
            raise PoolError(f"names must be a list of region names, got {names!r}")
        lost, ms = self.pool.localize(names)
        if any(lost.values()):
            log.warning(
                "rank %d: localized %d lost pages in %.1f ms: %s",
                self.rank,
                sum(map(len, lost.values())),
                ms,
                {name: pages for name, pages in lost.items() if pages},
            )
        return {"ok": True, "lost": lost, "ms": ms}, []

    def _op_remap(self, frame: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        region = self.pool.get(frame.get("name"))
        if region.device is None:
            ms = self.pool.remap(region.name, frame.get("pages"))
        else:
            ms = self.pool.remap_device(region.name, frame.get("pages"))
        log.info("rank %d: remapped %s in %.1f ms", self.rank, region.name, ms)
        return {"ok": True, "ms": ms}, []

    def _op_export(self, frame: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        start = time.perf_counter()
        fds, self._close_after_send = self.pool.export(frame.get("name"), frame.get("pages"))
        return {"ok": True, "exported": len(fds), "ms": (time.perf_counter() - start) * 1e3}, fds

    def _op_discard(self, frame: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        self.pool.discard(frame.get("name"), frame.get("pages"))
        log.warning(
            "rank %d: discarded pages %s of %s",
            self.rank,
            frame.get("pages"),
            frame.get("name"),
        )
        return {"ok": True}, []

    def _op_free(self, frame: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        self.pool.free(frame.get("name"))
        return {"ok": True}, []

    def _op_shutdown(self, frame: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        log.info("rank %d: shutdown requested", self.rank)
        self._running = False
        return {"ok": True}, []

    _OPS: ClassVar[Mapping[str, Callable[..., tuple[dict[str, Any], list[int]]]]] = (
        MappingProxyType(
            {
                "allocate": _op_allocate,
                "attach": _op_attach,
                "list": _op_list,
                "localize": _op_localize,
                "remap": _op_remap,
                "export": _op_export,
                "discard": _op_discard,
                "free": _op_free,
                "shutdown": _op_shutdown,
            }
        )
    )
    """Op name -> the method serving it."""

    def _drop(self, conn: socket.socket, reason: str | None) -> None:
        if reason:
            log.warning("rank %d: dropping client: %s", self.rank, reason)
        self._selector.unregister(conn)
        del self._readers[conn]
        conn.close()

    def _close(self) -> None:
        for conn in list(self._readers):
            self._drop(conn, None)
        if self._listener is not None:
            self._selector.unregister(self._listener)
            self._listener.close()
            self._listener = None
            with contextlib.suppress(FileNotFoundError):
                self.socket_path.unlink()
        self.pool.close()
        self._selector.close()
        if self._wakeup is not None:
            signal.set_wakeup_fd(-1)
            for sock in self._wakeup:
                sock.close()


def _region_reply(region: Region, fresh: bool) -> dict[str, Any]:
    return {"ok": True, **region.describe(), "fresh": fresh}


def _error(message: str) -> dict[str, Any]:
    return {"ok": False, "error": message}


def _is_live_socket(path: Path) -> bool:
    if not stat.S_ISSOCK(path.lstat().st_mode):
        return False
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(str(path))
    except OSError:
        return False
    finally:
        probe.close()
    return True


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m unbroken.state.manager``."""
    parser = argparse.ArgumentParser(
        prog="python -m unbroken.state.manager", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--socket", required=True, help="Unix socket path to serve")
    parser.add_argument("--rank", type=int, default=0, help="rank number (logs, memfd names)")
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    parser.add_argument(
        "--fd-budget",
        type=int,
        default=None,
        help="exported GPU-page fds kept for reuse (default: half the open-file limit)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    manager = StateManager(args.socket, rank=args.rank, fd_budget=args.fd_budget)
    try:
        manager.bind()
    except (RuntimeError, OSError) as exc:
        print(f"state manager: cannot serve {args.socket}: {exc}", file=sys.stderr)
        return 2
    manager.stop_on_signals(signal.SIGTERM, signal.SIGINT)
    manager.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
