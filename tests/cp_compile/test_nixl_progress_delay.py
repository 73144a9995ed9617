"""NIXL's progress thread waits in poll() instead of spinning (decision 77).

nixl's Python `nixl_agent` builds its C++ agent with `pthrDelay = 0`, which makes the
UCX progress thread spin (measured: an idle agent takes 99 % of a core; every P and D
rank holds one). `NixlTransport` builds its agent with the delay set. Checked on the
config the bound constructor receives (a recorder around it), and that the binding is
the caller's again afterwards; the CPU figures are in docs/benchmarks.md.
"""

from __future__ import annotations

import pytest

pytest.importorskip("nixl_cu12")

from nixl_cu12 import _api as api  # noqa: E402

from cp_compile.serving.kv_transfer.nixl import PROGRESS_DELAY_ENV, NixlTransport  # noqa: E402


@pytest.fixture
def seen(monkeypatch):
    calls: list[tuple[str, bool, int]] = []
    bound = api.nixlBind.nixlAgent

    def recorder(name, config):
        calls.append((name, config.useProgThread, config.pthrDelay))
        return bound(name, config)

    monkeypatch.setattr(api.nixlBind, "nixlAgent", recorder)
    monkeypatch.delenv(PROGRESS_DELAY_ENV, raising=False)
    return calls


def test_agent_progress_thread_waits_between_polls(seen, monkeypatch):
    recorder = api.nixlBind.nixlAgent
    NixlTransport("progress-default")
    assert seen == [("progress-default", True, 1000)]  # the thread runs, and sleeps 1 ms when idle
    assert api.nixlBind.nixlAgent is recorder  # the binding is restored after the one call
    monkeypatch.setenv(PROGRESS_DELAY_ENV, "0")  # nixl's own behaviour, on request
    NixlTransport("progress-spin")
    assert seen[-1] == ("progress-spin", True, 0)


def test_bad_delay_is_refused_by_name(seen, monkeypatch):
    monkeypatch.setenv(PROGRESS_DELAY_ENV, "1ms")
    with pytest.raises(ValueError, match=f"{PROGRESS_DELAY_ENV}='1ms'.*Fix"):
        NixlTransport("progress-bad")
    assert seen == []  # refused before an agent is built
