"""A corpus of bad inputs, each run through the real `unbroken` command as a subprocess: every
one must end with exit status 2, exactly one line on stderr naming what to fix, no traceback,
nothing launched (no events.jsonl) and no process of the run left behind.

Cases cover TOML syntax, unknown keys, wrong types, out-of-range values, impossible plans
(checked before launch by `unbroken.preflight` with the engine's own rules), missing and empty
corpora, unreadable files, bad `--inject` specs and flags, absurd sizes and unwritable outputs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

TINY = (
    '[model]\npreset = "tiny"\n'
    "[data]\ntokens_per_microbatch = 64\nmicrobatches = 2\nmax_documents = 50\n"
    "[train]\niterations = 3\n[parallel]\nworld_size = 2\n"
)
"""A valid job; cases change one thing in it."""


def _config(text: str):
    def setup(tmp: Path) -> list[str]:
        (tmp / "job.toml").write_text(text)
        return ["train", "--config", str(tmp / "job.toml"), "--out", str(tmp / "out")]

    return setup


def _tiny_with(*args: str):
    """The valid job with extra CLI arguments (`{tmp}` is the case's folder)."""

    def setup(tmp: Path) -> list[str]:
        return _config(TINY)(tmp) + [a.replace("{tmp}", str(tmp)) for a in args]

    return setup


def _data(corpus_setup, extra: str = ""):
    """The valid job reading a corpus that `corpus_setup(tmp)` makes; returns its path."""

    def setup(tmp: Path) -> list[str]:
        path = corpus_setup(tmp)
        text = TINY.replace("[data]\n", f"[data]\ncorpus = {str(path)!r}\n{extra}")
        return _config(text)(tmp)

    return setup


def _empty_dir(tmp: Path) -> Path:
    (tmp / "docs").mkdir()
    return tmp / "docs"


def _file(name: str, content: bytes):
    def make(tmp: Path) -> Path:
        (tmp / name).write_bytes(content)
        return tmp / name

    return make


def _raw_config(content: bytes):
    def setup(tmp: Path) -> list[str]:
        (tmp / "job.toml").write_bytes(content)
        return ["train", "--config", str(tmp / "job.toml"), "--out", str(tmp / "out")]

    return setup


def _config_is_a_directory(tmp: Path) -> list[str]:
    (tmp / "conf.d").mkdir()
    return ["train", "--config", str(tmp / "conf.d"), "--out", str(tmp / "out")]


def _out_under_a_file(tmp: Path) -> list[str]:
    (tmp / "a_file").write_text("x")
    return [*_config(TINY)(tmp)[:-1], str(tmp / "a_file" / "run")]


def _huge_model_strict(tmp: Path) -> list[str]:
    huge = TINY.replace('"tiny"\n', '"tiny"\ndim = 16384\nffn_dim = 65536\n')
    return [*_config(huge)(tmp), "--strict"]


def _plan(**parallel) -> str:
    body = "".join(f"{k} = {v!r}\n" for k, v in parallel.items())
    return TINY.replace("[parallel]\nworld_size = 2\n", f"[parallel]\n{body}")


CASES = {
    # syntax and schema
    "toml-syntax": (_config("[train\niterations = 3\n"), "not valid TOML"),
    "unknown-table": (_config(TINY + "[modle]\npreset = 'tiny'\n"), "unknown key 'modle'"),
    "unknown-key": (_config(TINY + "[checkpoint]\nintervall = 2\n"), "'checkpoint.intervall'"),
    "wrong-type-int": (
        _config(TINY.replace("iterations = 3", 'iterations = "three"')),
        "'train.iterations' must be an integer",
    ),
    "wrong-type-bool": (
        _config(TINY + "[checkpoint]\nenabled = 'yes'\n"),
        "'checkpoint.enabled' must be true or false",
    ),
    "wrong-type-list": (
        _config(TINY.replace("[train]\n", "[train]\nno_decay = 'embed.*'\n")),
        "'train.no_decay' must be a list",
    ),
    "bad-choice": (_config(_plan(world_size=2, schedule="pipedream")), "choose one of"),
    "negative-lr": (
        _config(TINY.replace("iterations = 3", "iterations = 3\nlr = -0.1")),
        "train.lr must be positive",
    ),
    "zero-microbatches": (
        _config(TINY.replace("microbatches = 2", "microbatches = 0")),
        "data.microbatches must be at least 1",
    ),
    "timeouts-inverted": (
        _config(TINY + "[recovery]\nheartbeat_timeout_s = 0.01\n"),
        "heartbeat_interval_s < heartbeat_timeout_s",
    ),
    "empty-no-decay-pattern": (
        _config(TINY.replace("[train]\n", "[train]\nno_decay = ['']\n")),
        "train.no_decay[0] is empty",
    ),
    # the model
    "unknown-preset": (_config(TINY.replace('"tiny"', '"huge"')), "model.preset 'huge'"),
    "heads-do-not-divide-dim": (
        _config(TINY.replace('"tiny"\n', '"tiny"\ndim = 66\n')),
        "must be divisible by n_heads",
    ),
    "factory-not-importable": (
        _config(TINY.replace('preset = "tiny"', 'factory = "no_such_module:build"')),
        "cannot import module 'no_such_module'",
    ),
    "factory-malformed": (
        _config(TINY.replace('preset = "tiny"', 'factory = "no_colon"')),
        "model.factory must look like 'module:function'",
    ),
    "no-decay-matches-nothing": (
        _config(TINY.replace("[train]\n", "[train]\nno_decay = ['emebd.*']\n")),
        "train.no_decay[0] = 'emebd.*': matches no parameter",
    ),
    # impossible plans
    "tp-does-not-divide-world": (_config(_plan(world_size=6, tp=4)), "does not divide"),
    "tp-not-power-of-two": (_config(_plan(world_size=6, tp=3)), "power of two"),
    "tp-vs-kv-heads": (
        _config(_plan(world_size=4, tp=4)),
        "parallel.tp = 4: model n_kv_heads=2 is not divisible by the TP degree 4",
    ),
    "more-stages-than-layers": (
        _config(_plan(world_size=16, pp=8, schedule="interleaved", virtual_stages=2)),
        "cannot split 2 layers into 16 non-empty stages",
    ),
    "microbatches-vs-interleaving": (
        _config(
            _plan(world_size=2, pp=2, schedule="interleaved", virtual_stages=2)
            .replace('"tiny"\n', '"tiny"\nn_layers = 4\n')
            .replace("microbatches = 2", "microbatches = 3")
        ),
        "data.microbatches = 3 with parallel.schedule = 'interleaved'",
    ),
    "interleaved-without-virtual-stages": (
        _config(_plan(world_size=2, pp=2, schedule="interleaved")),
        "virtual_stages >= 2",
    ),
    # absurd sizes and devices
    "absurd-world-size": (
        _config(_plan(world_size=100000)),
        "parallel.world_size = 100000: the job trains on this machine's CPU",
    ),
    "absurd-memory-strict": (
        _huge_model_strict,
        "memory: the job needs about",
    ),
    # data
    "corpus-missing": (_data(lambda tmp: tmp / "nowhere"), "corpus path not found"),
    "corpus-empty-folder": (_data(_empty_dir), "has no files"),
    "corpus-empty-jsonl": (_data(_file("empty.jsonl", b"")), "has no documents with text"),
    "corpus-jsonl-not-json": (_data(_file("bad.jsonl", b"{not json\n")), "not valid JSON"),
    "corpus-jsonl-wrong-field": (
        _data(_file("docs.jsonl", b'{"body": "hello"}\n')),
        "expected an object with a string field 'text'",
    ),
    # unreadable or missing files
    "config-missing": (
        lambda tmp: ["train", "--config", str(tmp / "none.toml"), "--out", str(tmp / "o")],
        "config file not found",
    ),
    "config-is-a-directory": (_config_is_a_directory, "config file not found"),
    "config-not-utf8": (_raw_config(b"\xff\xfe[train]\x00\x81\n"), "cannot read the config"),
    # fault specs and flags
    "inject-unknown-kind": (_tiny_with("--inject", "explode:rank=0,iter=1"), "unknown kind"),
    "inject-unknown-field": (
        _tiny_with("--inject", "kill:rank=0,iter=1,when=now"),
        "unknown field(s) ['when']",
    ),
    "inject-no-rank": (_tiny_with("--inject", "kill:iter=1"), "'rank=' is required"),
    "inject-not-a-number": (_tiny_with("--inject", "kill:rank=x,iter=1"), "fault 'kill:rank=x"),
    "inject-rank-out-of-range": (
        _tiny_with("--inject", "kill:rank=7,iter=1"),
        "rank 7 does not exist",
    ),
    "inject-two-triggers": (
        _tiny_with("--inject", "hang:rank=0,iter=1,at=2.0"),
        "give exactly one trigger",
    ),
    "iterations-zero": (_tiny_with("--iterations", "0"), "--iterations 0: give at least 1"),
    "iterations-not-int": (_tiny_with("--iterations", "ten"), "invalid int value: 'ten'"),
    "missing-config-flag": (lambda tmp: ["train", "--out", str(tmp / "o")], "--config"),
    "unknown-command": (lambda tmp: ["trian"], "invalid choice: 'trian'"),
    # outputs
    "out-under-a-file": (_out_under_a_file, "is a file, not a directory"),
    "out-read-only": (_tiny_with("--out", "/proc/unbroken-out"), "cannot write there"),
    "checkpoint-dir-under-a-file": (
        lambda tmp: _config(TINY + f"[checkpoint]\ndir = {str(tmp / 'job.toml' / 'c')!r}\n")(tmp),
        "checkpoint.dir",
    ),
    # the demo's own flags
    "demo-world-size": (
        lambda tmp: ["demo", "--quick", "--world-size", "100000", "--out", str(tmp / "o")],
        "parallel.world_size = 100000",
    ),
    "demo-tp-vs-kv-heads": (
        lambda tmp: ["demo", "--quick", "--tp", "4", "--out", str(tmp / "o")],
        "n_kv_heads=2 is not divisible by the TP degree 4",
    ),
}


def _left_behind(session: int, marker: str) -> list[str]:
    """Live processes of the command's session, or naming the case's folder."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone meanwhile
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        state, pgrp, sid = fields[0], int(fields[2]), int(fields[3])
        if state != "Z" and (session in (pgrp, sid) or marker in cmdline):
            found.append(f"{entry.name}: {cmdline[:120]}")
    return found


@dataclass(frozen=True)
class _Refusal:
    """What one case's command did: its exit status, stderr, whether it launched anything and
    the processes it left behind (read as soon as it ended)."""

    returncode: int
    stderr: str
    launched: bool
    left: list[str]


def _run_case(name: str, tmp: Path) -> _Refusal:
    setup, _ = CASES[name]
    argv = setup(tmp)
    proc = subprocess.Popen(
        [sys.executable, "-m", "unbroken", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own session: anything it starts stays findable
        cwd=tmp,
    )
    try:
        _, stderr = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    launched = bool(list(tmp.rglob("events.jsonl")))
    return _Refusal(proc.returncode, stderr, launched, _left_behind(proc.pid, str(tmp)))


@pytest.fixture(scope="module")
def refusals(tmp_path_factory) -> dict[str, _Refusal]:
    """Every case's command, two at a time (each is a process that mostly imports torch and
    checks its input: on 2 cores the corpus takes about half as long); each in its own
    folder and session, so what one leaves behind is never another's."""
    dirs = {name: tmp_path_factory.mktemp(name) for name in sorted(CASES)}
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(_run_case, name, d) for name, d in dirs.items()}
        return {name: f.result() for name, f in futures.items()}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_bad_input_is_refused_with_one_line_and_nothing_left_running(refusals, name):
    r = refusals[name]
    stderr = r.stderr
    assert r.returncode == 2, stderr
    assert "Traceback" not in stderr
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, stderr
    assert lines[0].startswith("unbroken"), lines[0]
    assert "error:" in lines[0]
    assert CASES[name][1] in lines[0], lines[0]
    assert not r.launched, "something was launched"
    assert r.left == []


def test_the_corpus_has_at_least_25_cases():
    assert len(CASES) >= 25
