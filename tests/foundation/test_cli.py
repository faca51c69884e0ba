"""User errors: one clear line naming the key/file and the fix, exit 2, no traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _unbroken(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "unbroken", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=120,
    )


@pytest.mark.parametrize(
    ("toml", "needle"),
    [
        ("[train]\nlrr = 1.0\n", "unknown key 'train.lrr'"),
        ("[train]\nlr = 'fast'\n", "key 'train.lr' must be a number"),
        ("[parallel]\nworld_size = 6\ndp = 4\n", "parallel degrees don't divide the world"),
        ("[parallel]\nworld_size = 6\ntp = 4\n", "tp*pp = 4 does not divide"),
        ("[parallel]\nworld_size = 6\ntp = 3\n", "tp must be a power of two"),
        ("[parallel]\nworld_size = 4\npp = 2\nschedule = 'interleaved'\n", "virtual_stages >= 2"),
        ("[bogus]\nx = 1\n", "unknown key 'bogus'"),
        ("[data]\ncorpus = '/no/such/dir'\n", "corpus path not found"),
        ("[model]\npreset = 'huge'\n", "model.preset 'huge' is unknown"),
        ("inject = ['explode:rank=0,iter=1']\n", "unknown kind 'explode'"),
        ("[recovery]\nheartbeat_timeout_s = 0.05\n", "heartbeat_interval_s < heartbeat_timeout_s"),
        ("[train\n", "not valid TOML"),
        ("[protection]\nchunk_bytes = 192\n", "divides page_bytes"),
    ],
)
def test_bad_config_is_one_line_exit_2(tmp_path, toml, needle):
    cfg = tmp_path / "job.toml"
    cfg.write_text(toml)
    r = _unbroken("train", "--config", str(cfg), "--out", str(tmp_path / "out"))
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr
    assert "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("unbroken: error:")
    if needle.startswith(("unknown key", "key ")):
        assert str(cfg) in lines[0]


def test_debug_shows_the_traceback(tmp_path):
    cfg = tmp_path / "job.toml"
    cfg.write_text("[train]\nlrr = 1.0\n")
    r = _unbroken("--debug", "train", "--config", str(cfg))
    assert r.returncode == 2 and "Traceback" in r.stderr


def test_missing_config_and_bad_cli_fault(tmp_path):
    r = _unbroken("train", "--config", str(tmp_path / "none.toml"))
    assert r.returncode == 2 and "config file not found" in r.stderr
    cfg = tmp_path / "job.toml"
    cfg.write_text("")
    r = _unbroken("train", "--config", str(cfg), "--inject", "kill:rank=9,iter=1")
    assert r.returncode == 2 and "rank 9 does not exist" in r.stderr
