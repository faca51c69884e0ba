"""The live metrics server of a job: Prometheus metrics and a status page over HTTP, served from
the coordinator's process while the job runs (`metrics.port`, `--metrics-port`).

    GET /metrics       the current run's registry in Prometheus' text format (`metrics.prom`)
    GET /              the status page: one self-contained HTML file (inline CSS and JS, no
                       external request), which polls /status.json once a second
    GET /status.json   the run's status (`metrics.status.RunStatus.snapshot`) and the list of
                       the job's runs; `?run=NAME` picks an earlier run of the job

One `LiveServer` per job, one `LiveRun` (status + its own Prometheus registry) per run: a job
with a reference runs "reference" then "faulty", and the faulty run's ETTR is measured against
the reference's rows once it finished. The HTTP server (the standard library's
`ThreadingHTTPServer`) answers from its own threads; the run's state is only read there, under
the status's lock. The server binds 127.0.0.1 unless `metrics.host` says otherwise.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any
from urllib.parse import parse_qs, urlparse

from prometheus_client import CONTENT_TYPE_LATEST

from unbroken.metrics.analysis import RecoveryBreakdown
from unbroken.metrics.observer import RunInfo, RunObserver
from unbroken.metrics.prom import RunMetrics
from unbroken.metrics.status import RunStatus

__all__ = ["LiveRun", "LiveServer"]


class LiveRun(RunObserver):
    """One run's live view: its status and its Prometheus metrics, fed by its monitor."""

    def __init__(self, run: str, reference_rows: list[dict[str, Any]] | None = None) -> None:
        self.run = run
        self.status = RunStatus(reference_rows)
        self.metrics = RunMetrics(self.status, run)
        self._parts: tuple[RunObserver, ...] = (self.status, self.metrics)

    def started(self, info: RunInfo) -> None:
        for p in self._parts:
            p.started(info)

    def iteration(self, row: dict[str, Any]) -> None:
        for p in self._parts:
            p.iteration(row)

    def timing(self, row: dict[str, Any]) -> None:
        for p in self._parts:
            p.timing(row)

    def event(self, event: dict[str, Any]) -> None:
        for p in self._parts:
            p.event(event)

    def recovered(self, breakdown: RecoveryBreakdown) -> None:
        for p in self._parts:
            p.recovered(breakdown)

    def finished(self, state: str, reason: str) -> None:
        for p in self._parts:
            p.finished(state, reason)


def _page() -> bytes:
    return resources.files("unbroken.metrics").joinpath("status_page.html").read_bytes()


class LiveServer:
    """Serves a job's live metrics and status page until `close`.

    Args:
        host: address to bind (127.0.0.1: this machine only).
        port: TCP port; 0 picks a free one (see `url`).

    Raises:
        OSError: the address cannot be bound (port in use, no such address).
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self._lock = threading.Lock()
        self._runs: dict[str, LiveRun] = {}
        self._current: LiveRun | None = None
        self._page = _page()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                server._answer(self)

            def log_message(self, format: str, *args: Any) -> None:
                return  # no access log on the training job's terminal

        self._httpd = ThreadingHTTPServer((host, port), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, name="unbroken-live", daemon=True
        )
        self._thread.start()

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}/"

    def observe(self, run: str) -> LiveRun:
        """A new run of the job starts: its live view, now the one `/metrics` serves."""
        with self._lock:
            ref = self._runs.get("reference")
            rows = list(ref.status.all_rows) if ref is not None and run != "reference" else None
            live = LiveRun(run, rows or None)
            self._runs[run] = live
            self._current = live
            return live

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)

    # -- HTTP ---------------------------------------------------------------------------------
    def _pick(self, query: str) -> LiveRun | None:
        name = parse_qs(query).get("run", [""])[0]
        with self._lock:
            return self._runs.get(name, self._current) if name else self._current

    def _status(self, query: str) -> dict[str, Any]:
        live = self._pick(query)
        body = live.status.snapshot() if live is not None else {"run": "", "state": "waiting"}
        with self._lock:
            body["runs"] = [
                {"run": name, "state": r.status.state, "current": r is self._current}
                for name, r in self._runs.items()
            ]
        return body

    def _answer(self, h: BaseHTTPRequestHandler) -> None:
        url = urlparse(h.path)
        if url.path == "/metrics":
            live = self._pick(url.query)
            body = live.metrics.exposition() if live is not None else b""
            self._send(h, 200, CONTENT_TYPE_LATEST, body)
        elif url.path == "/status.json":
            body = json.dumps(self._status(url.query), allow_nan=False, default=str).encode()
            self._send(h, 200, "application/json", body)
        elif url.path in ("/", "/status", "/index.html"):
            self._send(h, 200, "text/html; charset=utf-8", self._page)
        else:
            self._send(h, 404, "text/plain; charset=utf-8", b"not found: try / or /metrics\n")

    @staticmethod
    def _send(h: BaseHTTPRequestHandler, code: int, ctype: str, body: bytes) -> None:
        h.send_response(code)
        h.send_header("Content-Type", ctype)
        h.send_header("Content-Length", str(len(body)))
        h.send_header("Cache-Control", "no-store")
        h.end_headers()
        h.wfile.write(body)
