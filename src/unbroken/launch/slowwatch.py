"""The coordinator's fail-slow watch: feeds every completed iteration — rank 0's iteration time
plus every rank's compute timings and micro-batch workload (`timings.jsonl`) — to the
workload-aware detector (`unbroken.detect.FailSlowDetector`), once per iteration and in order,
and turns its decisions into events. Redone iterations (after a recovery) are not fed again,
and the first `GRACE_ITERS` iterations of a new trainer generation are not fed at all: right
after a recovery the new shadows start up and caches are cold — a transient of the recovery,
not of a device.
"""

from __future__ import annotations

from typing import Any

from unbroken.detect import DetectorConfig, FailSlowDetector, Observation, RankTiming, Verdict
from unbroken.metrics.log import JsonlLog

__all__ = ["GRACE_ITERS", "SlowWatch"]

GRACE_ITERS = 3


class SlowWatch:
    def __init__(self, world_size: int, events: JsonlLog, say, cfg: DetectorConfig | None = None):
        self.world_size = world_size
        self.events = events
        self.say = say
        self.detector = FailSlowDetector(cfg)
        self._timings: dict[int, dict[int, dict[str, Any]]] = {}
        self._metrics: dict[int, dict[str, Any]] = {}
        self._last_fed = -1
        self.disabled: str | None = None
        """Why the watch stopped (a dataset without document lengths, a detector error)."""
        self._generation = 0
        self._grace_until = -1

    def add_timing(self, rec: dict[str, Any]) -> None:
        if rec["iter"] > self._last_fed:
            self._timings.setdefault(rec["iter"], {})[rec["rank"]] = rec

    def add_metric(self, m: dict[str, Any]) -> None:
        generation = m.get("generation", 0)
        if generation != self._generation:
            self._generation = generation
            self._grace_until = m["iter"] + GRACE_ITERS - 1
        if m["iter"] > self._last_fed:
            self._metrics[m["iter"]] = m

    def _disable(self, reason: str) -> None:
        self.disabled = reason
        self._metrics.clear()
        self._timings.clear()
        self.events.emit("detector_disabled", reason=reason)
        self.say(f"fail-slow detection off: {reason}")

    def pump(self) -> None:
        """Feed every iteration whose metrics and all ranks' timings have arrived. The watch is
        an observer: whatever goes wrong in it switches it off with an event, never stops the
        job."""
        if self.disabled:
            return
        try:
            self._pump()
        except Exception as exc:
            self._disable(f"{type(exc).__name__}: {exc}")

    def _pump(self) -> None:
        while self._metrics:
            it = min(self._metrics)
            ranks = self._timings.get(it, {})
            if len(ranks) < self.world_size:
                if any(i > it for i in self._metrics) and len(self._metrics) > 3:
                    self._drop(it)  # a rank died mid-iteration; never complete
                    continue
                return
            m = self._metrics.pop(it)
            self._timings.pop(it, None)
            self._last_fed = it
            if it <= self._grace_until:
                continue
            if not all(any(mb) for r in ranks.values() for mb in r["doc_lengths"] or [[]]):
                self._disable("the data source reports no document lengths (T_MB = aN + b sum l^2)")
                return
            obs = Observation(
                iteration=it,
                seconds=m["iter_s"] - m.get("ckpt_s", 0.0),
                doc_lengths=[ranks[r]["doc_lengths"] for r in sorted(ranks)],
                ranks={r: RankTiming.from_dict(ranks[r]) for r in ranks},
            )
            self._decide(self.detector.observe(obs))

    def _drop(self, it: int) -> None:
        self._metrics.pop(it, None)
        self._timings.pop(it, None)
        self._last_fed = max(self._last_fed, it)

    def _decide(self, d) -> None:
        if d.verdict in (Verdict.WARMUP, Verdict.QUIET, Verdict.ACCEPTED, Verdict.KNOWN):
            return
        fields = {
            "verdict": d.verdict.value,
            "iteration": d.iteration,
            "change_iteration": d.change_iteration,
            "observed_over_predicted": d.observed_over_predicted,
            "validation_s": d.validation_s,
        }
        if d.report is not None:
            r = d.report
            self.events.emit(
                "fail_slow",
                rank=r.rank,
                what=r.what,
                stage=r.stage,
                factor=r.factor,
                since_iter=r.iteration,
                detected_at=r.detected_at,
                **fields,
            )
            self.say(
                (
                    f"fail-slow detected: rank {r.rank}"
                    if r.rank is not None
                    else "fail-slow detected: the sync stage (every rank's all-reduce)"
                )
                + f" {'communicates' if r.what == 'comm' else 'runs'} {r.factor:.2f}x slower "
                f"since iteration {r.iteration} (detected after iteration {r.detected_at})"
            )
        else:
            self.events.emit("change_point", **fields)

    @property
    def overhead_s(self) -> float:
        return self.detector.observe_s
