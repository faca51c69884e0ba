"""The skip ledger (`tests/ci_skips.py`): one line counting skips by reason, and a skipped
`ci_required` test fails the run under `--require-ci-tests` (what `./dev test` passes)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SUITE = """
import pytest

@pytest.mark.ci_required
def test_required_and_skipped():
    pytest.skip("libfoo is not installed")

@pytest.mark.ci_required
def test_required_and_run():
    pass

def test_plain_skip():
    pytest.skip("needs a CUDA device")

def test_plain_skip_again():
    pytest.skip("needs a CUDA device")

@pytest.mark.xfail(reason="known", strict=True)
def test_expected_failure():
    assert False
"""


def _pytest(tmp_path: Path, files: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "pytest.ini").write_text(
        "[pytest]\nmarkers =\n    ci_required: must run in CI\naddopts = --strict-markers\n"
    )
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.ci_skips", "-p", "no:cacheprovider",
         "--rootdir", str(tmp_path), "-c", str(tmp_path / "pytest.ini"), str(tmp_path), *args],
        cwd=ROOT,  # `tests.ci_skips` is importable from the repository root
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip


def _ledger_line(out: str) -> str:
    (line,) = [x for x in out.splitlines() if x.startswith("skipped: ")]
    return line


def test_a_skipped_required_test_fails_the_strict_run_and_is_named(tmp_path):
    r = _pytest(tmp_path, {"test_suite.py": SUITE}, "--require-ci-tests")
    assert r.returncode == 1, r.stdout
    assert _ledger_line(r.stdout) == (
        "skipped: 3 test(s) (2 x needs a CUDA device; 1 x libfoo is not installed); "
        "ci_required skipped: 1"
    )
    assert "test_suite.py::test_required_and_skipped: libfoo is not installed" in r.stdout
    assert "1 xfailed" in r.stdout  # an expected failure is not counted as a skip


def test_without_the_option_the_skip_is_counted_and_named_but_passes(tmp_path):
    r = _pytest(tmp_path, {"test_suite.py": SUITE})
    assert r.returncode == 0, r.stdout
    assert _ledger_line(r.stdout).endswith("ci_required skipped: 1")
    assert "allowed without --require-ci-tests" in r.stdout


@pytest.mark.parametrize("strict", [True, False])
def test_a_run_without_required_skips_passes_and_still_counts(tmp_path, strict):
    suite = SUITE.replace('    pytest.skip("libfoo is not installed")\n', "    pass\n")
    r = _pytest(tmp_path, {"test_suite.py": suite}, *(["--require-ci-tests"] if strict else []))
    assert r.returncode == 0, r.stdout
    assert _ledger_line(r.stdout) == (
        "skipped: 2 test(s) (2 x needs a CUDA device); ci_required skipped: 0"
    )


def test_a_module_skipped_whole_is_counted_and_a_failure_still_fails(tmp_path):
    files = {
        "test_gone.py": 'import pytest\npytest.skip("no GPU here", allow_module_level=True)\n',
        "test_bad.py": "def test_fails():\n    assert 1 == 2\n",
    }
    r = _pytest(tmp_path, files, "--require-ci-tests")
    assert r.returncode == 1, r.stdout  # the failure, not the ledger
    assert _ledger_line(r.stdout) == "skipped: 1 test(s) (1 x no GPU here); ci_required skipped: 0"
