"""The coordinator's own load, as the soak and an operator see it: how long it takes to handle
what arrives (a control message, a poll of the run's logs), and how many keys the job store
holds. Every `STATS_S` seconds, and once at the end, a `coordinator_stats` event:

    messages          control messages handled in the window
    handle_ms_p50/max per message: decoding done, the core's decision and its sends
    poll_ms_p50/max   per poll of the run's logs (metrics, timings, events) by the monitor
    store_keys        keys in the job store now (every generation's rendezvous keys included)
    fault_markers     of them, the injected faults' fired-markers (`inject/<fault>`: one per
                      scheduled fault that fired, bounded by the schedule, not by recoveries)

A coordinator that slows as the job ages (a growing event log read whole, a table scanned per
message) shows as handling time rising over the run; a store whose keys pile up per
generation, as `store_keys` rising per recovery (`unbroken bench soak` fits both).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from unbroken.metrics.log import JsonlLog

__all__ = ["STATS_S", "LoadStats"]

STATS_S = 30.0


class LoadStats:
    """Args: events (the run's log), store_keys (the store's key count now), fault_markers
    (how many of them are fired-fault markers)."""

    def __init__(
        self,
        events: JsonlLog,
        store_keys: Callable[[], int | None],
        fault_markers: Callable[[], int] = lambda: 0,
    ) -> None:
        self.events, self.store_keys, self.fault_markers = events, store_keys, fault_markers
        self.handle_s: list[float] = []
        self.poll_s: list[float] = []
        self.t_window = time.monotonic()

    def handled(self, seconds: float) -> None:
        self.handle_s.append(seconds)

    def polled(self, seconds: float) -> None:
        self.poll_s.append(seconds)

    def tick(self, final: bool = False) -> None:
        """Emit the window's figures when it is `STATS_S` old (or `final`), then start anew."""
        now = time.monotonic()
        if not final and now - self.t_window < STATS_S:
            return
        self.events.emit(
            "coordinator_stats",
            window_s=round(now - self.t_window, 2),
            messages=len(self.handle_s),
            **_ms("handle", self.handle_s),
            **_ms("poll", self.poll_s),
            store_keys=self.store_keys(),
            fault_markers=self.fault_markers(),
            final=final,
        )
        self.handle_s, self.poll_s, self.t_window = [], [], now


def _ms(name: str, values: list[float]) -> dict[str, float | None]:
    if not values:
        return {f"{name}_ms_p50": None, f"{name}_ms_max": None}
    return {
        f"{name}_ms_p50": round(statistics.median(values) * 1e3, 3),
        f"{name}_ms_max": round(max(values) * 1e3, 3),
    }
