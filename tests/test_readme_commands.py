"""The README's command table names commands and flags that exist: each row's command answers
`--help`, and every `--flag` the row shows is in that help."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from unbroken.cli.main import main

README = Path(__file__).resolve().parents[1] / "README.md"


def _rows() -> list[tuple[list[str], list[str]]]:
    """(command words, flags) of each row of the README's command table."""
    rows = []
    for line in README.read_text().splitlines():
        m = re.match(r"\| `unbroken ([^`]*)` \|", line)
        if not m:
            continue
        text = m.group(1)
        words = re.match(r"[a-z ]+", text).group(0).split()
        flags = sorted(set(re.findall(r"--[a-z][a-z-]*", text)))
        rows.append((words, flags))
    return rows


def test_the_readme_has_a_command_table():
    commands = {" ".join(w) for w, _ in _rows()}
    assert {"demo", "train", "report", "plan", "bench plan", "bench adapt"} <= commands


@pytest.mark.parametrize(("words", "flags"), _rows(), ids=lambda x: " ".join(x))
def test_each_readme_command_and_its_flags_exist(words, flags, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([*words, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    missing = [f for f in flags if f not in out]
    assert not missing, f"unbroken {' '.join(words)} --help does not show {missing}"
