"""Fixtures and plugins for the whole suite: the skip ledger (`tests.ci_skips`)."""

pytest_plugins = ["tests.ci_skips"]
