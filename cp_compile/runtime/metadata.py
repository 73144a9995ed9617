"""Global attention metadata: the data and its batch kind (docs/architecture.md §4).

The metadata is what one device would see: identical on every rank. Block ids
name *virtual* blocks of `block_size * pcp * dcp` tokens (`CPConfig.virtual_block_size`:
the cache is sharded over the pcp * dcp ranks of the context-parallel group); each
rank's page with the same id holds its `block_size` of them, so block tables need no
localisation.

Building it for a batch of requests, with the block allocator, is
`metadata_build.py`; validating it (`validate_metadata`, `validate_step`,
`validate_forward_args`) before any cache write is `metadata_checks.py`. Validation
reads only the global metadata and the cache geometry, which are identical on every
rank of a DCP group, so every rank reaches the same verdict before any collective:
no rank waits on a peer that refused.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from cp_compile.base.config import DECODE_KINDS, BatchKind
from cp_compile.base.errors import CapacityError, MetadataError

__all__ = ["AttentionMetadata", "BatchKind", "DECODE_KINDS", "CapacityError", "MetadataError", "batch_kind",
           "is_fresh"]


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


def batch_kind(meta: AttentionMetadata, num_speculative_tokens: int = 0) -> BatchKind:
    """"decode" when every request brings at most one new token; "verify" when
    speculation is on (`num_speculative_tokens` = k > 0) and every request brings at
    most k + 1 (the last accepted token and k drafts to score; fewer near a request's
    end or in a draft model's catch-up step); else "prefill" (prefill, chunked, mixed).

    PCP shards only prefill tokens and DSA-CP keeps decode in the TP head layout, so
    those configs compile one graph per kind (`CPConfig.graph_per_batch_kind`), and
    speculation adds a verify graph; the compiled entry picks the graph with this,
    outside the graph. It reads the metadata on the host (one sync, like
    `validate_step`); a graph cannot branch on tensor values without a
    data-dependent control flow. Every graph is exact for every batch; the kind only
    picks the layout that serves it best.
    """
    qsl = meta.query_start_loc
    if qsl.numel() < 2:
        return "decode"
    longest = int((qsl[1:] - qsl[:-1]).max())
    if longest <= 1:
        return "decode"
    return "verify" if longest <= num_speculative_tokens + 1 and num_speculative_tokens > 0 else "prefill"


def is_fresh(meta: AttentionMetadata) -> bool:
    """Whether no request of the step has cached context: every request's context
    length (seq_len minus its new tokens) is 0, as in a prompt prefill or the first
    chunk of a chunked prefill. PCP runs such prefill steps in their own graph
    ("fresh_prefill", docs/pcp.md §4), whose attention has no context part; the
    compiled entry reads it on the host, like `batch_kind` (one sync)."""
    qsl = meta.query_start_loc
    context = meta.seq_lens.long() - (qsl[1:] - qsl[:-1]).long()  # [B]
    return not bool(context.any())
