import json

import pytest

from unbroken.detect.detector import DetectorConfig, FailSlowDetector
from unbroken.detect.events import DetectionEvent, DetectionKind, JsonlSink
from unbroken.detect.levels import Level, slow_factor_for, throughput_loss
from unbroken.detect.timing import PhaseTimer
from unbroken.train.phases import Phase

from .synth import series


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_phase_timer_splits_micro_batches_and_reduce():
    clock = FakeClock()
    got = []
    timer = PhaseTimer(rank=3, on_record=got.append, clock=clock)
    # 3 micro-batches: forward 1 s, backward 2 s each; all-reduce 0.5 s after the last backward.
    for m in range(3):
        timer(Phase.FORWARD, 7, m, 3)
        clock.now += 1.0
        timer(Phase.BACKWARD, 7, m, 3)
        clock.now += 2.0 if m < 2 else 2.5
    timer(Phase.PROTECT, 7, 0, 1)
    (rec,) = got
    assert rec.rank == 3 and rec.iteration == 7
    assert rec.mb_s == (3.0, 3.0)
    assert rec.forward_s == (1.0, 1.0, 1.0)
    assert rec.compute_s == 7.0
    assert rec.reduce_s == 2.5
    assert timer.records == [rec]


def test_phase_timer_records_an_iteration_without_micro_batches():
    # A rank the placement left none (an empty replica, `Trainer._probe`): its iteration starts
    # at the ordered reduction's first hook; the record has no micro-batch, its reduction and
    # wait for the others (2 s) and the step up to PROTECT. Its next iteration's probe is timed
    # as its one micro-batch.
    clock = FakeClock()
    got = []
    timer = PhaseTimer(rank=3, on_record=got.append, clock=clock)
    timer(Phase.ALLREDUCE, 8, 0, 2)
    clock.now += 2.0
    timer(Phase.ALLREDUCE, 8, 1, 2)
    clock.now += 0.5
    timer(Phase.REDUCED, 8, 0, 1)
    clock.now += 0.25
    timer(Phase.PROTECT, 8, 0, 1)
    timer(Phase.FORWARD, 9, 0, 1)
    clock.now += 1.0
    timer(Phase.BACKWARD, 9, 0, 1)
    clock.now += 2.0
    timer(Phase.ALLREDUCE, 9, 0, 2)
    clock.now += 0.5
    timer(Phase.REDUCED, 9, 0, 1)
    timer(Phase.PROTECT, 9, 0, 1)
    empty, probe = got
    assert (empty.iteration, empty.mb_s, empty.forward_s, empty.compute_s) == (8, (), (), 0.0)
    assert empty.reduce_s == 2.75 and empty.comm_s == 2.5
    assert (probe.iteration, probe.mb_s, probe.forward_s) == (9, (3.0,), (1.0,))


class FakeGpu:
    """A stream whose work lags the host: an event's time is when the GPU reaches it."""

    def __init__(self) -> None:
        self.now = 0.0
        self.synced = 0

    def event_class(self):
        gpu = self

        class Event:
            def __init__(self, enable_timing: bool = False) -> None:
                assert enable_timing
                self.t = None

            def record(self) -> None:
                self.t = gpu.now

            def synchronize(self) -> None:
                gpu.synced += 1

            def elapsed_time(self, end) -> float:
                return (end.t - self.t) * 1e3  # milliseconds, as CUDA reports

        return Event


def test_on_a_gpu_the_timer_times_the_stream_not_the_host(monkeypatch):
    import torch

    gpu, host = FakeGpu(), FakeClock()
    monkeypatch.setattr(torch.cuda, "Event", gpu.event_class())
    got = []
    timer = PhaseTimer(rank=1, on_record=got.append, clock=host, device=torch.device("cuda", 0))
    for m in range(2):  # the host enqueues instantly; the GPU takes 1 s forward, 3 s backward
        timer(Phase.FORWARD, 4, m, 2)
        gpu.now += 1.0
        timer(Phase.BACKWARD, 4, m, 2)
        gpu.now += 3.0
    timer(Phase.PROTECT, 4, 0, 1)
    assert got == [] and gpu.synced == 0  # nothing read (nor waited for) inside the iteration
    timer.flush()
    (rec,) = got
    assert host.now == 0.0  # the host clock saw nothing of the work
    assert rec.mb_s == (4.0,) and rec.forward_s == (1.0, 1.0)
    assert rec.compute_s == 5.0 and rec.reduce_s == 3.0
    assert gpu.synced == 1
    timer.flush()  # idempotent
    assert len(got) == 1


def test_localization_picks_the_slowed_rank_among_four():
    obs = series(world=4, slow_rank=2, slow_iter=25, factor=1.8, seed=5)
    det = FailSlowDetector(DetectorConfig())
    reports = [d.report for o in obs if (d := det.observe(o)).report]
    assert [r.rank for r in reports] == [2]
    assert reports[0].factor == pytest.approx(1.8, rel=0.1)


def test_a_single_rank_slowed_is_reported_against_its_own_healthy_pace():
    """Seen on one H200: with one rank there are no peers, and validation called a 2.9x
    slowdown a false alarm. The workload model fitted on its warm-up is its reference."""
    obs = series(world=1, slow_rank=0, slow_iter=25, factor=1.8, seed=5)
    det = FailSlowDetector(DetectorConfig())
    reports = [d.report for o in obs if (d := det.observe(o)).report]
    assert [r.rank for r in reports] == [0]
    assert reports[0].factor == pytest.approx(1.8, rel=0.15)
    healthy = series(world=1, slow_rank=0, slow_iter=10_000, factor=1.8, seed=5)
    det = FailSlowDetector(DetectorConfig())
    healthy_reports = [d.report for o in healthy if (d := det.observe(o)).report]
    assert healthy_reports == []


@pytest.mark.parametrize(("level", "loss"), [("weak", 0.35), ("medium", 0.55), ("severe", 0.70)])
def test_levels_cost_their_throughput_share(level, loss):
    for share in (1.0, 0.6):
        f = slow_factor_for(level, share)
        assert throughput_loss(f, share) == pytest.approx(loss)
    assert slow_factor_for(Level.WEAK) < slow_factor_for(Level.MEDIUM) < slow_factor_for("severe")


def test_unknown_level_is_rejected():
    with pytest.raises(ValueError):
        slow_factor_for("mild")


def test_jsonl_sink_writes_the_event_log_format(tmp_path):
    sink = JsonlSink(tmp_path / "events.jsonl", run="train")
    sink.emit(
        DetectionEvent(
            kind=DetectionKind.FAIL_SLOW, rank=1, stage=0, factor=2.0, iteration=5, detected_at=6
        )
    )
    sink.close()
    (rec,) = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert rec["run"] == "train" and rec["kind"] == "failure_detected"
    assert rec["reason"] == "fail_slow" and rec["rank"] == 1 and rec["detected_iter"] == 6
    assert isinstance(rec["t"], float)


def test_phase_timer_with_all_reduce_hooks_times_every_micro_batch_and_the_comm():
    clock, cpu = FakeClock(), FakeClock()
    timer = PhaseTimer(rank=0, clock=clock, cpu_clock=cpu)
    for m in range(3):
        timer(Phase.FORWARD, 4, m, 3)
        clock.now += 1.0
        cpu.now += 0.5  # half of the wall time on the CPU (the rest descheduled)
        timer(Phase.BACKWARD, 4, m, 3)
        clock.now += 2.0
        cpu.now += 1.0
    for b in range(2):
        timer(Phase.ALLREDUCE, 4, b, 2)
        clock.now += 0.25
    timer(Phase.REDUCED, 4, 0, 1)
    clock.now += 0.1
    timer(Phase.PROTECT, 4, 0, 1)
    (rec,) = timer.records
    assert rec.mb_s == (3.0, 3.0, 3.0)  # the last one ends at the first ALLREDUCE hook
    assert rec.mb_cpu_s == (1.5, 1.5, 1.5)
    assert rec.comm_s == 0.5 and rec.reduce_s == pytest.approx(2.0 + 0.5 + 0.1)
    assert rec.compute_s == 7.0
