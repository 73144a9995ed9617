"""What DCP costs on the wire: the model of docs/architecture.md §5 and a meter for real runs.

`decode_comm_bytes_per_layer` predicts the bytes one rank sends per attention
layer; `CollectiveMeter` measures the bytes of the `_c10d_functional` collectives
actually issued (eager mode), from their real input tensors, so a test can hold
the prediction against a run.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_c10d = torch.ops._c10d_functional


def merge_collectives(num_tokens: int, heads_per_rank: int, q_dim: int, v_dim: int, dtype_bytes: int, dcp: int,
                      merge: str = "ag_rs", fold: bool = False) -> list[tuple[str, int]]:
    """(collective kind, bytes this rank sends) of one DCP attention layer and step, in order.

    Q all-gather: (N-1)*T*H*dq*bytes. AG+RS merge: LSE all-gather (N-1)*T*N*H*4 plus
    reduce-scatter (N-1)*T*H*dv*bytes. All-to-all merge: (N-1)*T*H*(dv*bytes + 4)
    ([out | lse], lse as 4 raw bytes). Query replication ("replicate"): no Q all-gather
    (every rank computed the group's queries), the all-to-all only. The all-reduce fold
    (`fold`, decision 62): the Q all-gather (none when replicated) and the LSE all-gather
    only; the output merge is left to the TP all-reduce after o_proj, whose bytes do not
    change (not counted here, as for every merge).
    """
    n, t, h = dcp, num_tokens, heads_per_rank
    if n == 1:  # no DCP group: nothing to merge, whatever the (possibly still 'auto') merge says
        return []
    if merge not in ("ag_rs", "a2a", "replicate"):
        raise ValueError(f"merge={merge!r}: use 'ag_rs', 'a2a' or 'replicate' (the DCP pass resolves 'auto' per "
                         "graph; pass the merge it chose, PassRecord.decision)")
    if fold:
        lses = [("all_gather", (n - 1) * t * n * h * 4)]
        return lses if merge == "replicate" else [("all_gather", (n - 1) * t * h * q_dim * dtype_bytes)] + lses
    a2a = ("all_to_all", (n - 1) * t * h * (v_dim * dtype_bytes + 4))
    if merge == "replicate":
        return [a2a]
    q = ("all_gather", (n - 1) * t * h * q_dim * dtype_bytes)
    if merge == "ag_rs":
        return [q, ("all_gather", (n - 1) * t * n * h * 4), ("reduce_scatter", (n - 1) * t * h * v_dim * dtype_bytes)]
    return [q, a2a]


def decode_comm_bytes_per_layer(num_tokens: int, heads_per_rank: int, q_dim: int, v_dim: int, dtype_bytes: int,
                                dcp: int, merge: str = "ag_rs") -> int:
    """Bytes one rank sends per DCP attention layer and step (independent of context length):
    the sum over `merge_collectives`; AG+RS (N-1)*T*H*((dq+dv)*bytes + 4N), A2A
    (N-1)*T*H*((dq+dv)*bytes + 4), replicate (N-1)*T*H*(dv*bytes + 4)."""
    return sum(b for _, b in merge_collectives(num_tokens, heads_per_rank, q_dim, v_dim, dtype_bytes, dcp, merge))


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class CollectiveMeter(TorchDispatchMode):
    """Counts bytes this rank sends through functional collectives while active.

    sent[op] accumulates: all-gather input * (N-1); reduce-scatter and all-to-all
    (equal splits) input * (N-1)/N; all-reduce (ring) input * 2(N-1)/N.
    """

    # Compiled graphs (aot_eager) call higher-order ops (auto_functionalized for the cache
    # writes): they pass through, and the collectives inside the graph are still counted.
    supports_higher_order_operators = True

    def __init__(self) -> None:
        super().__init__()
        self.sent: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)

    @property
    def total(self) -> int:
        return sum(self.sent.values())

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is _c10d.all_gather_into_tensor.default:
            n = args[1]
            self._add("all_gather", _bytes(args[0]) * (n - 1))
        elif func is _c10d.reduce_scatter_tensor.default:
            n = args[2]
            self._add("reduce_scatter", _bytes(args[0]) * (n - 1) // n)
        elif func is _c10d.all_to_all_single.default:
            splits = args[2]
            n = len(splits)
            self._add("all_to_all", _bytes(args[0]) * (n - 1) // n)
        elif func is _c10d.all_reduce.default:
            n = torch.distributed.get_world_size(torch.distributed.distributed_c10d._resolve_process_group(args[2]))
            self._add("all_reduce", 2 * _bytes(args[0]) * (n - 1) // n)
        return func(*args, **kwargs)

    def _add(self, op: str, nbytes: int) -> None:
        self.sent[op] += nbytes
        self.calls[op] += 1
