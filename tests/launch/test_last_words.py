"""What the agent reports as a dead rank's last words (`RankExited.said`, shown as the reason
of a failure): the trainer's own line about its failure, not what torch printed after it."""

from __future__ import annotations

from unbroken.launch.agent.procs import last_line

NCCL_EXIT = (
    "[rank0]:[W1202 04:16:11.914332740 ProcessGroupNCCL.cpp:1575] Warning: WARNING: "
    "destroy_process_group() was not called before program exit, which can leak resources."
)


def _log(tmp_path, *lines: str) -> str:
    path = tmp_path / "gen1-rank0.log"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_the_trainers_own_line_wins_over_torch_warnings_after_it(tmp_path):
    own = "unbroken-trainer[rank 0] in restore: RuntimeError: CUDA out of memory"
    log = _log(tmp_path, "Traceback (most recent call last):", "  ...", own, "", NCCL_EXIT)
    assert last_line(log) == own


def test_without_the_trainers_line_a_torch_warning_is_skipped_unless_it_is_all(tmp_path):
    assert last_line(_log(tmp_path, "Segmentation fault", NCCL_EXIT)) == "Segmentation fault"
    assert last_line(_log(tmp_path, NCCL_EXIT)) == NCCL_EXIT[:300]
    assert last_line(str(tmp_path / "missing.log")) == ""
    assert len(last_line(_log(tmp_path, "x" * 1000))) == 300
