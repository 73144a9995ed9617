"""Global attention metadata and a simple block allocator (DESIGN.md §4).

The metadata is what one device would see: identical on every rank. Block ids
name *virtual* blocks of `block_size * dcp` tokens; each rank's page with the same
id holds its `block_size` of them, so block tables need no localisation.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Sequence

import torch


@dataclass
class AttentionMetadata:
    """Flattened batch of T tokens over B requests (vLLM style)."""

    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32: context + new tokens
    block_table: torch.Tensor  # [B, nb] int32 virtual block ids (0-padded past the length)
    slot_mapping: torch.Tensor  # [T] int64, -1 = padding token
    positions: torch.Tensor  # [T] int64 request-local positions (0 for padding)

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]

    @property
    def num_reqs(self) -> int:
        return self.seq_lens.shape[0]

    def to(self, device: torch.device | str) -> "AttentionMetadata":
        return AttentionMetadata(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})


class CapacityError(RuntimeError):
    """The KV cache has no free block for a request."""


class BlockAllocator:
    """Hands out virtual block ids for requests; frees them when requests finish.

    `block_tokens` is the virtual block size (block_size * dcp). Running out of
    blocks raises `CapacityError` instead of reusing a live block.
    """

    def __init__(self, num_blocks: int, block_tokens: int) -> None:
        if num_blocks < 1 or block_tokens < 1:
            raise ValueError(f"num_blocks={num_blocks} and block_tokens={block_tokens} must be >= 1")
        self.num_blocks = num_blocks
        self.block_tokens = block_tokens
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out 0, 1, 2, ...
        self._tables: dict[int, list[int]] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks(self, req_id: int) -> list[int]:
        return self._tables.get(req_id, [])

    def ensure(self, req_id: int, num_tokens: int) -> list[int]:
        """Grow request `req_id` to hold `num_tokens` tokens; returns its block ids."""
        table = self._tables.setdefault(req_id, [])
        need = -(-num_tokens // self.block_tokens) - len(table)
        if need > len(self._free):
            raise CapacityError(
                f"request {req_id} needs {need} more blocks of {self.block_tokens} tokens for "
                f"{num_tokens} tokens but only {len(self._free)} of {self.num_blocks} are free. "
                f"Fix: allocate a larger KV cache (more blocks), raise decode_context_parallel_size, "
                f"or finish requests first")
        for _ in range(max(need, 0)):
            table.append(self._free.pop())
        return table

    def free(self, req_id: int) -> None:
        self._free.extend(reversed(self._tables.pop(req_id, [])))


def build_attention_metadata(
    requests: Sequence[tuple[int, int]],
    allocator: BlockAllocator,
    req_ids: Sequence[int] | None = None,
    num_padding_tokens: int = 0,
    max_blocks_per_req: int | None = None,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """Metadata for one step: `requests[i] = (context_len, new_tokens)`.

    context_len tokens of request i are already cached; this step writes and
    attends `new_tokens` more. Blocks are allocated on demand from `allocator`
    (request ids default to 0..B-1). `num_padding_tokens` appends padding tokens
    (slot -1), as a graph-mode runtime pads a batch to a captured size.
    `max_blocks_per_req` fixes the block-table width (so shapes stay static).
    """
    if req_ids is None:
        req_ids = list(range(len(requests)))
    if len(req_ids) != len(requests):
        raise ValueError(f"{len(requests)} requests but {len(req_ids)} request ids")
    bt_tokens = allocator.block_tokens
    q_lens, seq_lens, tables, slots, positions = [], [], [], [], []
    for rid, (ctx, new) in zip(req_ids, requests):
        if ctx < 0 or new < 1:
            raise ValueError(f"request {rid}: context_len={ctx} must be >= 0 and new_tokens={new} >= 1")
        table = allocator.ensure(rid, ctx + new)
        pos = torch.arange(ctx, ctx + new)
        blk = torch.tensor(table, dtype=torch.int64)[pos // bt_tokens]
        slots.append(blk * bt_tokens + pos % bt_tokens)
        positions.append(pos)
        q_lens.append(new)
        seq_lens.append(ctx + new)
        tables.append(table)
    width = max(len(t) for t in tables)
    if max_blocks_per_req is not None:
        if width > max_blocks_per_req:
            raise CapacityError(f"a request needs {width} blocks but max_blocks_per_req={max_blocks_per_req}")
        width = max_blocks_per_req
    block_table = torch.zeros(len(requests), width, dtype=torch.int32)
    for i, t in enumerate(tables):
        block_table[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    qsl = torch.zeros(len(requests) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    pad = torch.full((num_padding_tokens,), -1, dtype=torch.int64)
    meta = AttentionMetadata(
        query_start_loc=qsl,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=block_table,
        slot_mapping=torch.cat(slots + [pad]),
        positions=torch.cat(positions + [torch.zeros(num_padding_tokens, dtype=torch.int64)]),
    )
    return meta.to(device)
