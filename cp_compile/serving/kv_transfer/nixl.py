"""NIXL transport (UCX backend): DRAM on CPU hosts, HBM on GPUs the same way.

`nixl-cu12` is an optional dependency, imported here only. Its UCX backend moves
registered memory between processes; a descriptor outside the peer's registered
memory is refused by NIXL itself (NIXL_ERR_NOT_FOUND), and a peer whose process
died is reported at once (NIXL_ERR_REMOTE_DISCONNECT), which the connector turns
into a failed request within its bounded wait.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from cp_compile.serving.kv_transfer.transport import KVTransferError, XferState


def _api():
    try:
        from nixl_cu12._api import nixl_agent, nixl_agent_config
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise KVTransferError("the NIXL transport needs the nixl-cu12 package. Fix: "
                              "pip install --no-deps nixl-cu12==1.5.1 (tools/bootstrap.sh does)") from exc
    return nixl_agent, nixl_agent_config


class NixlTransport:
    def __init__(self, name: str, mem_type: str = "DRAM", backends: tuple[str, ...] = ("UCX",)) -> None:
        """mem_type: "DRAM" for CPU caches, "VRAM" for accelerator memory (the caches' device)."""
        nixl_agent, nixl_agent_config = _api()
        self.name = name
        self.mem_type = mem_type
        self._agent = nixl_agent(name, nixl_agent_config(backends=list(backends)))
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
