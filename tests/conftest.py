"""Suite-wide hooks: tests can leave a line for the end-of-run summary (CI logs show it)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

_NOTES = pytest.StashKey[list[str]]()


@pytest.fixture
def summary_note(request: pytest.FixtureRequest) -> Callable[[str], None]:
    """Append a line to the terminal summary printed after the run."""
    notes = request.config.stash.setdefault(_NOTES, [])
    return notes.append


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    notes = config.stash.get(_NOTES, [])
    if notes:
        terminalreporter.section("cp-compile notes")
        for line in notes:
            terminalreporter.write_line(line)
