"""`ForwardExecutor`: the step loop's executor over a bare model forward on this rank.

    ex = ForwardExecutor(forward, kv_layers, BlockAllocator(num_blocks, cfg.virtual_block_size))
    loop = StepLoop(ex, Scheduler(num_blocks, cfg.virtual_block_size, max_batch))

`forward(input_ids [T], positions [T], caches, meta) -> logits [T, V]`, or
`(logits, hidden [T, D])` (a target that feeds an MTP proposer), compiled or not,
over the global metadata of the plan (what one device would see). Every rank runs
its own loop on the same requests (SPMD: the example serving loop, speculative
decoding), so each rank's allocator follows the same plans.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from cp_compile.runtime.metadata import AttentionMetadata
from cp_compile.runtime.metadata_build import BlockAllocator, build_attention_metadata
from cp_compile.serving.loop.scheduler import StepPlan


class ForwardExecutor:
    """Applies a plan's frees and rollbacks to `alloc`, then runs `forward` once over
    its items; `execute` returns each item's last-token logits [V] (`StepLoop`)."""

    def __init__(self, forward: Callable[..., Any], caches: Sequence[tuple[torch.Tensor, ...]],
                 alloc: BlockAllocator, padding: int = 0, max_blocks_per_req: int | None = None,
                 device: torch.device | str = "cpu") -> None:
        self.forward = forward
        self.caches = caches
        self.alloc = alloc
        self.padding = padding
        self.max_blocks_per_req = max_blocks_per_req
        self.device = device
        self.meta: AttentionMetadata | None = None  # the last step's metadata (for a caller's checks)
        self.last: list[torch.Tensor] = []  # the last step's last-token logits [V] per item

    def release(self, plan: StepPlan) -> StepPlan:
        """Free `plan.free` and roll back `plan.truncate` now; returns the plan without
        them (a phase that runs before `execute` and reads the blocks calls this first)."""
        for rid in plan.free:
            self._free(rid)
        for rid, keep in plan.truncate:
            self._truncate(rid, keep)
        return StepPlan(plan.items)

    def _free(self, rid: int) -> None:
        self.alloc.free(rid)

    def _truncate(self, rid: int, keep: int) -> None:
        self.alloc.truncate(rid, keep)

    def run(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """One forward over the items: (logits [T, V], hidden [T, D] or None,
        query_start_loc [B + 1] int64 on the host)."""
        reqs = [(cached, len(new)) for _, cached, new in plan.items]
        meta = build_attention_metadata(reqs, self.alloc, req_ids=[rid for rid, _, _ in plan.items],
                                        num_padding_tokens=self.padding,
                                        max_blocks_per_req=self.max_blocks_per_req, device=self.device)
        ids = torch.tensor([t for _, _, new in plan.items for t in new] + [0] * self.padding, device=self.device)
        with torch.no_grad():
            out = self.forward(ids, meta.positions, self.caches, meta)
        logits, hidden = (out[0], out[1]) if isinstance(out, tuple) else (out, None)
        self.meta = meta
        return logits, hidden, meta.query_start_loc.long().cpu()

    def execute(self, plan: StepPlan) -> list[torch.Tensor]:
        plan = self.release(plan)
        if not plan.items:
            return []
        logits, _, qsl = self.run(plan)
        self.last = list(logits[qsl[1:] - 1])  # [V] per item: its last token's
        return self.last
