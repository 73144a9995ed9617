"""Batches shared by the exactness tests: two steps through one set of caches.

Step A prefills each request's context; step B is the batch under test, given as
(context_len, new_tokens) per request. Request 0 of "mixed" and "spec_decode" is new
in step B; short contexts (shorter than dcp) leave some ranks without a key.
"""

from __future__ import annotations

import torch

from cp_compile.runtime.metadata import AttentionMetadata
from cp_compile.runtime.metadata_build import BlockAllocator, build_attention_metadata

STEP_B: dict[str, list[tuple[int, int]]] = {
    "decode": [(9, 1), (1, 1), (7, 1), (16, 1)],
    "mixed": [(0, 5), (9, 1), (7, 3), (1, 1), (12, 4)],
    "spec_decode": [(0, 1), (6, 3), (15, 2)],
}


def two_step_metas(batch: str, *, dcp: int, block_size: int, num_blocks: int,
                   padding: int = 2) -> tuple[AttentionMetadata, AttentionMetadata]:
    """Global metadata of step A (contexts) and step B (`STEP_B[batch]`), with
    `padding` padding tokens each, on virtual blocks of block_size * dcp tokens."""
    alloc = BlockAllocator(num_blocks, block_size * dcp)
    reqs = STEP_B[batch]
    ids = list(range(len(reqs)))
    a = [(i, (0, c)) for i, (c, _) in zip(ids, reqs) if c > 0]
    meta_a = build_attention_metadata([r for _, r in a], alloc, req_ids=[i for i, _ in a],
                                      num_padding_tokens=padding)
    meta_b = build_attention_metadata(reqs, alloc, req_ids=ids, num_padding_tokens=padding,
                                      max_blocks_per_req=num_blocks // 2)
    return meta_a, meta_b


def meta_args(m: AttentionMetadata) -> tuple[torch.Tensor, ...]:
    """The metadata arguments of the attention ops, in their order."""
    return (m.slot_mapping, m.block_table, m.seq_lens, m.query_start_loc)
