"""What a test run skipped, said out loud: a pytest plugin loaded by `tests/conftest.py`.

Every run ends with one line counting the skipped tests by reason (modules skipped as a whole at
collection included). A test marked `@pytest.mark.ci_required` is one whose skip would hide a
missing check (the ISA-L cross-checks, the tests that need root or cgroup v1): with
`--require-ci-tests`, which `./dev test` (and so CI) passes, such a skip fails the run and is
named. Without the option (a developer's targeted run) it is only counted and named.

It never changes a test's own outcome, only the session's exit status. An expected failure
(xfail) is not a skip.
"""

from __future__ import annotations

from collections import Counter

import pytest

__all__ = ["MARKER", "REQUIRE_OPTION", "SkipLedger", "pytest_addoption", "pytest_configure"]

REQUIRE_OPTION = "--require-ci-tests"
MARKER = "ci_required"


def _reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    longrepr = report.longrepr
    text = str(longrepr[2]) if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    lines = text.removeprefix("Skipped: ").strip().splitlines()
    return lines[0] if lines else "(no reason given)"


class SkipLedger:
    """The skips of one session, and the hooks that record and report them.

    Args:
        strict: fail the session when a `ci_required` test was skipped.
    """

    def __init__(self, strict: bool) -> None:
        self.strict = strict
        self.skipped: list[tuple[str, str]] = []
        """(node id, reason) of every skip."""
        self.required: list[tuple[str, str]] = []
        """The same for skipped tests marked `ci_required`."""

    def add(self, nodeid: str, reason: str, required: bool) -> None:
        self.skipped.append((nodeid, reason))
        if required:
            self.required.append((nodeid, reason))

    def line(self) -> str:
        """The one-line count by reason, most frequent first."""
        by_reason = Counter(reason for _, reason in self.skipped)
        parts = "; ".join(f"{n} x {reason}" for reason, n in by_reason.most_common())
        return (
            f"skipped: {len(self.skipped)} test(s)"
            + (f" ({parts})" if parts else "")
            + f"; {MARKER} skipped: {len(self.required)}"
        )

    # -- hooks ----------------------------------------------------------------------------
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.skipped and not hasattr(report, "wasxfail"):
            self.add(report.nodeid, _reason(report), MARKER in report.keywords)

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.skipped:  # a module skipped whole: its tests' markers were never read
            self.add(report.nodeid, _reason(report), False)

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if self.strict and self.required and exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter) -> None:
        terminalreporter.write_line(self.line())
        verdict = "fails the run" if self.strict else f"allowed without {REQUIRE_OPTION}"
        for nodeid, reason in self.required:
            terminalreporter.write_line(
                f"{MARKER} test skipped ({verdict}): {nodeid}: {reason}", red=True, bold=True
            )


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        REQUIRE_OPTION,
        action="store_true",
        default=False,
        help=f"fail the run when a test marked {MARKER} was skipped (./dev test passes it)",
    )


def pytest_configure(config: pytest.Config) -> None:
    ledger = SkipLedger(strict=bool(config.getoption(REQUIRE_OPTION)))
    config.pluginmanager.register(ledger, "unbroken-ci-skips")
