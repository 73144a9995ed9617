"""Suite-wide hooks: tests can leave a line for the end-of-run summary (CI logs show it)."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from pathlib import Path

import pytest

_NOTES = pytest.StashKey[list[str]]()


@pytest.fixture
def summary_note(request: pytest.FixtureRequest) -> Callable[[str], None]:
    """Append a line to the terminal summary printed after the run."""
    notes = request.config.stash.setdefault(_NOTES, [])
    return notes.append


def pytest_configure(config: pytest.Config) -> None:
    """Refuse to test another checkout's code. `cp_compile.ops` / `cp_compile.passes` are the
    top-level ops/ and passes/ mapped by the editable install: run from a git worktree with
    another checkout's venv, `cp_compile` comes from the worktree (the cwd) but those two
    from the checkout the venv was installed from, so the tests would pass or fail on code
    that is not the one under test (seen: a new pass that never ran, and passed)."""
    root = Path(config.rootpath).resolve()
    for name in ("cp_compile", "cp_compile.ops", "cp_compile.passes"):
        spec = importlib.util.find_spec(name)
        origin = Path(spec.origin).resolve() if spec is not None and spec.origin else None
        if origin is None or root not in origin.parents:
            raise pytest.UsageError(
                f"{name} is imported from {origin}, not from this checkout ({root}). Fix: use this checkout's "
                f"own venv (`bash tools/bootstrap.sh` here), or `pip install -e {root}` into the one you run")


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
