"""Building global attention metadata for a batch of requests, and the block allocator behind it.

`BlockAllocator` hands out virtual block ids (transactional: an operation that
raises leaves it as it was); `build_attention_metadata` turns `(context_len,
new_tokens)` per request into the `AttentionMetadata` one device would see.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from cp_compile.base.errors import CapacityError
from cp_compile.runtime.metadata import AttentionMetadata

__all__ = ["BlockAllocator", "build_attention_metadata"]


def _check_count(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an integer >= {minimum}")
    return value


class BlockAllocator:
    """Hands out virtual block ids for requests; frees them when requests finish.

    `block_tokens` is the virtual block size (block_size * pcp * dcp). Running out of
    blocks raises `CapacityError` instead of reusing a live block. Every operation
    is transactional: one that raises leaves the allocator exactly as it was, and
    `transaction()` extends that to a group of operations (a whole batch).
    """

    def __init__(self, num_blocks: int, block_tokens: int) -> None:
        _check_count("num_blocks", num_blocks, 1)
        _check_count("block_tokens", block_tokens, 1)
        self.num_blocks = num_blocks
        self.block_tokens = block_tokens
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out 0, 1, 2, ...
        self._tables: dict[int, list[int]] = {}
        # Undo log of the open transaction: (req_id, table length before, table existed).
        self._undo: list[tuple[int, int, bool]] | None = None

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks(self, req_id: int) -> list[int]:
        return list(self._tables.get(req_id, []))

    def blocks_needed(self, req_id: int, num_tokens: int) -> int:
        """More blocks request `req_id` needs to hold `num_tokens` tokens (0 if none)."""
        return max(-(-num_tokens // self.block_tokens) - len(self._tables.get(req_id, [])), 0)

    def ensure(self, req_id: int, num_tokens: int) -> list[int]:
        """Grow request `req_id` to hold `num_tokens` tokens; returns its block ids."""
        _check_count("num_tokens", num_tokens, 0)
        need = self.blocks_needed(req_id, num_tokens)
        if need > len(self._free):
            raise CapacityError(
                f"request {req_id} needs {need} more blocks of {self.block_tokens} tokens for "
                f"{num_tokens} tokens but only {len(self._free)} of {self.num_blocks} are free. "
                f"Fix: allocate a larger KV cache (more blocks), raise decode_context_parallel_size, "
                f"or finish requests first")
        existed = req_id in self._tables
        table = self._tables.setdefault(req_id, [])
        if self._undo is not None:
            self._undo.append((req_id, len(table), existed))
        for _ in range(need):
            table.append(self._free.pop())
        return list(table)

    def free(self, req_id: int) -> None:
        if self._undo is not None:
            raise RuntimeError("free() inside a transaction cannot be undone; free requests between batches")
        self._free.extend(reversed(self._tables.pop(req_id, [])))

    def truncate(self, req_id: int, num_tokens: int) -> list[int]:
        """Shrink request `req_id` to the blocks `num_tokens` tokens need; returns the
        block ids given back (speculative decoding: the blocks that held only rejected
        draft tokens). Tokens past `num_tokens` in a kept block are stale, and a step
        writes every position it attends that is not cached, so they are never read."""
        _check_count("num_tokens", num_tokens, 0)
        if self._undo is not None:
            raise RuntimeError("truncate() inside a transaction cannot be undone; truncate between batches")
        table = self._tables.get(req_id, [])
        keep = -(-num_tokens // self.block_tokens)
        freed = table[keep:]
        del table[keep:]
        self._free.extend(reversed(freed))
        return freed

    def transaction(self) -> "_Transaction":
        """`with allocator.transaction(): ...` — an exception inside undoes every `ensure`."""
        return _Transaction(self)

    def _rollback(self, undo: list[tuple[int, int, bool]]) -> None:
        for req_id, length, existed in reversed(undo):
            table = self._tables[req_id]
            # Blocks go back in the reverse order they were popped: the free list is
            # restored exactly, so the next allocation hands out the same ids.
            while len(table) > length:
                self._free.append(table.pop())
            if not existed:
                del self._tables[req_id]


class _Transaction:
    def __init__(self, alloc: BlockAllocator) -> None:
        self.alloc = alloc

    def __enter__(self) -> BlockAllocator:
        if self.alloc._undo is not None:
            raise RuntimeError("BlockAllocator transactions do not nest")
        self.alloc._undo = []
        return self.alloc

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        undo, self.alloc._undo = self.alloc._undo, None
        if exc_type is not None and undo:
            self.alloc._rollback(undo)


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
    Every argument and the capacity of the whole batch are checked before the first
    block is taken; a batch that fails leaves the allocator exactly as it was.
    """
    if len(requests) == 0:
        raise ValueError("empty batch: requests is empty. Fix: skip the step when no request has tokens to run "
                         "(a batch needs at least one (context_len, new_tokens) request)")
    if req_ids is None:
        req_ids = list(range(len(requests)))
    if len(req_ids) != len(requests):
        raise ValueError(f"{len(requests)} requests but {len(req_ids)} request ids. Fix: pass one request id per "
                         f"(context_len, new_tokens) entry, or none (ids 0..B-1)")
    if len(set(req_ids)) != len(req_ids):
        dup = next(r for r in req_ids if list(req_ids).count(r) > 1)
        raise ValueError(f"request id {dup} appears twice in one batch. Fix: one (context_len, new_tokens) entry "
                         f"per request; put all of its new tokens in that entry")
    _check_count("num_padding_tokens", num_padding_tokens, 0)
    for i, (rid, req) in enumerate(zip(req_ids, requests)):
        ctx, new = req
        if (isinstance(ctx, bool) or not isinstance(ctx, int) or ctx < 0 or isinstance(new, bool)
                or not isinstance(new, int) or new < 1):
            raise ValueError(f"request {i} (id {rid}): context_len={ctx!r} must be an integer >= 0 and "
                             f"new_tokens={new!r} an integer >= 1")
    bt_tokens = allocator.block_tokens
    # Whole-batch checks first, so a refused batch takes no block at all.
    widths = [max(len(allocator.blocks(rid)), -(-(ctx + new) // bt_tokens)) for rid, (ctx, new) in
              zip(req_ids, requests)]
    if max_blocks_per_req is not None:
        _check_count("max_blocks_per_req", max_blocks_per_req, 1)
        over = [i for i, w in enumerate(widths) if w > max_blocks_per_req]
        if over:
            i = over[0]
            raise CapacityError(f"request {i} (id {req_ids[i]}) needs {widths[i]} blocks of {bt_tokens} tokens for "
                                f"{sum(requests[i])} tokens but max_blocks_per_req={max_blocks_per_req}. Fix: raise "
                                f"max_blocks_per_req or cap the request's length")
    total_need = sum(allocator.blocks_needed(rid, ctx + new) for rid, (ctx, new) in zip(req_ids, requests))
    if total_need > allocator.num_free:
        raise CapacityError(f"the batch needs {total_need} more blocks of {bt_tokens} tokens but only "
                            f"{allocator.num_free} of {allocator.num_blocks} are free. Fix: allocate a larger KV "
                            f"cache (more blocks), raise decode_context_parallel_size, run fewer requests per "
                            f"step, or finish requests first")
    q_lens, seq_lens, tables, slots, positions = [], [], [], [], []
    with allocator.transaction():
        for rid, (ctx, new) in zip(req_ids, requests):
            table = allocator.ensure(rid, ctx + new)
            pos = torch.arange(ctx, ctx + new)
            blk = torch.tensor(table, dtype=torch.int64)[pos // bt_tokens]
            slots.append(blk * bt_tokens + pos % bt_tokens)
            positions.append(pos)
            q_lens.append(new)
            seq_lens.append(ctx + new)
            tables.append(table)
        width = max(len(t) for t in tables) if max_blocks_per_req is None else max_blocks_per_req
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
