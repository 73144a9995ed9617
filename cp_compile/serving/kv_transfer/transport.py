"""The transport interface the connector uses, and its errors.

A transport moves bytes between registered cache memory of two instances' ranks.
The connector pulls (the decode rank reads, as vLLM's NIXL connector does): it owns
the destination blocks, so it alone decides when they may be written and freed.
NIXL (`nixl.NixlTransport`) is the one built; a Mooncake or HCCL transport implements
the same calls.
"""

from __future__ import annotations

from typing import Any, Literal, Protocol

import numpy as np
import torch

XferState = Literal["DONE", "PROC", "ERR"]


class KVTransferError(RuntimeError):
    """A request's KV could not be moved (peer lost, timeout, refused descriptors)."""


class KVOwnershipError(KVTransferError):
    """A transfer would write blocks the request does not own (freed or reassigned)."""


class KVAlreadyImportedError(KVTransferError):
    """A producer's request was already imported (or expired on the producer): its
    blocks there may hold another request's KV now, so it is not read again."""


class KVTransport(Protocol):
    name: str  # this agent's unique name

    def register(self, tensors: list[torch.Tensor]) -> Any:
        """Make these (contiguous) tensors readable / writable by peers; returns a handle
        for `deregister`."""

    def deregister(self, handle: Any) -> None:
        """Forget a registration (before its memory is freed: the staging buffer grows)."""

    def metadata(self) -> bytes:
        """What a peer needs to reach this agent (exchanged through the store)."""

    def connect(self, metadata: bytes) -> str:
        """Add a peer from its `metadata()`; returns its name."""

    def read(self, peer: str, local: np.ndarray, remote: np.ndarray) -> Any:
        """Post a read of the peer's `remote` Nx3 (address, bytes, device) descriptors
        into `local`; returns a handle. Raises `KVTransferError` if the transport
        refuses them (e.g. outside the peer's registered memory) or the peer is gone."""

    def state(self, handle: Any) -> XferState:
        """DONE, PROC (in flight) or ERR; a lost peer may raise `KVTransferError`."""

    def release(self, handle: Any) -> None:
        """Forget a finished or failed read (an in-flight one is aborted)."""
