"""Two separate process worlds at once (a prefill and a decode instance), plus a
TCPStore both reach: each world is a `run_on_ranks` world of its own (own
rendezvous, own default group, own `init_parallel`); they meet only through the
store, whose port is passed to both as `store_port`."""

from __future__ import annotations

import threading
from typing import Any, Callable

from torch.distributed import TCPStore

from cp_compile.testing.multirank import run_on_ranks


def run_two_worlds(fn_a: Callable[..., Any], size_a: int, args_a: tuple, fn_b: Callable[..., Any], size_b: int,
                   args_b: tuple, timeout: float = 300.0, **kwargs: Any) -> tuple[Any, Any]:
    """Run `fn_a(rank, size_a, store_port, *args_a)` and `fn_b(...)` concurrently.

    Returns each world's per-rank results, or the exception its `run_on_ranks`
    raised (a world whose rank died returns its `RankFailed`, the other world still
    reports)."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    out: list[Any] = [None, None]

    def go(i: int, fn: Callable[..., Any], size: int, args: tuple) -> None:
        try:
            out[i] = run_on_ranks(fn, size, store.port, *args, timeout=timeout, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            out[i] = exc

    threads = [threading.Thread(target=go, args=(0, fn_a, size_a, args_a)),
               threading.Thread(target=go, args=(1, fn_b, size_b, args_b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    del store
    return out[0], out[1]
