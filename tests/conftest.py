"""Suite-wide hooks: tests can leave a line for the end-of-run summary (CI logs show it)."""

from __future__ import annotations

import json
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


def pytest_sessionfinish(session: pytest.Session) -> None:
    # Under pytest-xdist (the default run, pyproject addopts) each worker hands its notes
    # to the controller, whose terminal summary prints them.
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["cp_compile_notes"] = json.dumps(session.config.stash.get(_NOTES, []))


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:  # pytest-xdist's hook, on the controller
    notes = json.loads(getattr(node, "workeroutput", {}).get("cp_compile_notes", "[]"))
    node.config.stash.setdefault(_NOTES, []).extend(notes)
