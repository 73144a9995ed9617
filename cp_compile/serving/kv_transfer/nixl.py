"""NIXL transport (UCX backend): DRAM on CPU hosts, HBM on GPUs the same way.

`nixl-cu12` is an optional dependency, imported here only. Its UCX backend moves
registered memory between processes; a descriptor outside the peer's registered
memory is refused by NIXL itself (NIXL_ERR_NOT_FOUND), and a peer whose process
died is reported at once (NIXL_ERR_REMOTE_DISCONNECT), which the connector turns
into a failed request within its bounded wait.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

from cp_compile.serving.kv_transfer.transport import KVTransferError, XferState


# How long NIXL's progress thread sleeps in poll() between rounds when no UCX event
# woke it (µs; the thread rounds it up to whole ms). nixl's Python API fixes it at 0,
# which makes the thread spin: measured, an idle agent takes 99 % of a core (2.6 % at
# 1 ms). Each rank of each P / D instance holds one agent, so on a shared host the
# spinning threads took the cores the decode steps needed (decision 77). Events (a
# peer's request, a completion) still wake the thread at once through the workers'
# event fds; the initiator also progresses its reads itself when it polls their state.
# CP_COMPILE_NIXL_PROGRESS_DELAY_US overrides it (0: nixl's spinning thread).
PROGRESS_DELAY_ENV = "CP_COMPILE_NIXL_PROGRESS_DELAY_US"


def default_progress_delay_us() -> int:
    raw = os.environ.get(PROGRESS_DELAY_ENV, "1000")
    if not raw.isdigit():
        raise ValueError(f"{PROGRESS_DELAY_ENV}={raw!r}: not a whole number of microseconds. Fix: unset it "
                         "(1000) or give an int >= 0 (0 makes NIXL's progress thread spin)")
    return int(raw)


def _api():
    try:
        from nixl_cu12 import _api as api
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise KVTransferError("the NIXL transport needs the nixl-cu12 package. Fix: "
                              "pip install --no-deps nixl-cu12==1.5.1 (tools/bootstrap.sh does)") from exc
    return api


def make_agent(name: str, backends: list[str], progress_delay_us: int | None = None) -> Any:
    """A `nixl_agent` whose progress thread waits `progress_delay_us` in poll() instead of
    spinning. nixl_agent's constructor sets the C++ config's pthrDelay to 0 and builds the
    bound agent in the same call, with no argument for it; the bound constructor is wrapped
    for that one call to set the delay on the config it is given."""
    api = _api()
    delay = default_progress_delay_us() if progress_delay_us is None else progress_delay_us
    bound = api.nixlBind.nixlAgent

    def with_delay(agent_name: str, config: Any) -> Any:
        config.pthrDelay = delay
        return bound(agent_name, config)

    api.nixlBind.nixlAgent = with_delay
    try:
        return api.nixl_agent(name, api.nixl_agent_config(backends=backends))
    finally:
        api.nixlBind.nixlAgent = bound


class NixlTransport:
    def __init__(self, name: str, mem_type: str = "DRAM", backends: tuple[str, ...] = ("UCX",),
                 progress_delay_us: int | None = None) -> None:
        """mem_type: "DRAM" for CPU caches, "VRAM" for accelerator memory (the caches' device)."""
        self.name = name
        self.mem_type = mem_type
        self._agent = make_agent(name, list(backends), progress_delay_us)
        self._registered: list[Any] = []

    def register(self, tensors: list[torch.Tensor]) -> Any:
        for t in tensors:
            if not t.is_contiguous():
                raise ValueError("NIXL registers contiguous tensors only; allocate caches with allocate_kv_cache")
        if not tensors:
            return None
        reg = self._agent.register_memory(tensors)
        self._registered.append(reg)
        return reg

    def deregister(self, handle: Any) -> None:
        if handle is not None:
            self._agent.deregister_memory(handle)
            self._registered.remove(handle)

    def metadata(self) -> bytes:
        return self._agent.get_agent_metadata()

    def connect(self, metadata: bytes) -> str:
        name = self._agent.add_remote_agent(metadata)
        return name.decode() if isinstance(name, bytes) else name

    def read(self, peer: str, local: np.ndarray, remote: np.ndarray) -> Any:
        try:
            loc = self._agent.get_xfer_descs(np.ascontiguousarray(local, dtype=np.uint64), self.mem_type)
            rem = self._agent.get_xfer_descs(np.ascontiguousarray(remote, dtype=np.uint64), self.mem_type)
            handle = self._agent.initialize_xfer("READ", loc, rem, peer)
            if self._agent.transfer(handle) == "ERR":
                raise KVTransferError(f"NIXL refused to post a read from {peer}")
        except KVTransferError:
            raise
        except Exception as exc:  # nixl raises its own error classes (nixlRemoteDisconnectError, ...)
            raise KVTransferError(f"NIXL read from {peer} failed: {type(exc).__name__}: {exc}") from exc
        return handle

    def state(self, handle: Any) -> XferState:
        try:
            return self._agent.check_xfer_state(handle)
        except Exception as exc:
            raise KVTransferError(f"NIXL transfer state: {type(exc).__name__}: {exc}") from exc

    def release(self, handle: Any) -> None:
        try:
            self._agent.release_xfer_handle(handle)
        except Exception as exc:
            raise KVTransferError(f"NIXL could not release a transfer: {type(exc).__name__}: {exc}") from exc
