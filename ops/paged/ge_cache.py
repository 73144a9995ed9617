"""GE converters of the paged family: metadata localisation and cache writes.

- `cp::dcp_localize_metadata` -> a composition of GE primitives (FloorDiv, FloorMod,
  Mul, Add, Minimum/Maximum, Equal, LogicalAnd, SelectV2, GatherV2, Range, Cast):
  the formulas of `core/layout.py`, once per graph. No fused CANN op does this.
- `cp::cache_write` -> `ScatterNdUpdate(cache, [slot // BS, slot % BS], new)`
  (`core/ge_util.scatter_into`, which every family's cache write uses), the
  in-place scatter torch_npu exposes as `npu_scatter_nd_update_` (the way
  vLLM-Ascend writes MLA caches in torchair graph mode). Tokens whose local slot
  is -1 (owned by another DCP rank, or padding) write nothing in eager mode; here
  they are written to the cache's scratch block (its last page,
  `core/scratch_block.py`: `allocate_kv_cache(..., scratch_block=True)`), because
  CANN's aclnnScatterNdUpdate page says out-of-range indices are unsupported
  ("indices中的索引数据不支持越界") and one scatter cannot skip a row without a
  data-dependent shape. No block table names the scratch block, so nothing reads
  what lands there (issue 21; docs/torchair.md, docs/decisions.md).
- `cp::quant_cache_write` -> the int8 quantisation as GE primitives (ReduceMaxD, RealDiv,
  Round, ClipByValue, Cast; `core/ge_kv_quant.py`) and two such scatters: the codes into
  the pages, the fp32 scales into the scale cache (issue 39, decision 70).
"""

from __future__ import annotations

from typing import Any

from torchair._ge_concrete_graph import ge_apis as ge
from torchair.ge._ge_graph import DataType, Tensor

from cp_compile.ops.core.ge_kv_quant import quant_scatter_into
from cp_compile.ops.core.kv_quant import refuse_static_scale
from cp_compile.ops.core.ge_util import I32, I64, cast, const, local_len, scatter_into, token_positions, where


def convert_cache_write(new: Tensor, cache: Tensor, slot_mapping: Tensor, meta_outputs: Any = None):
    scatter_into(cache, new, slot_mapping)
    return None  # no outputs (auto_functionalized_v2 gives (None, new cache)); the cache is ScatterNdUpdate's ref output


def convert_dcp_localize_metadata(slot_mapping: Tensor, query_start_loc: Tensor, seq_lens: Tensor, cp: int,
                                  rank: int, interleave: int, block_size: int, meta_outputs: Any = None):
    s = cast(slot_mapping, I64)
    vbs = const(block_size * cp, I64)
    vb = ge.FloorDiv(s, vbs)
    off = ge.Sub(s, ge.Mul(vb, vbs))
    owner = ge.FloorMod(ge.FloorDiv(off, const(interleave, I64)), const(cp, I64))
    local = ge.Add(ge.Add(ge.Mul(vb, const(block_size, I64)),
                          ge.Mul(ge.FloorDiv(off, const(cp * interleave, I64)), const(interleave, I64))),
                   ge.FloorMod(off, const(interleave, I64)))
    keep = ge.LogicalAnd(ge.GreaterEqual(s, const(0, I64)), ge.Equal(owner, const(rank, I64)))
    slots = where(keep, local, const(-1, I64))

    seq = cast(local_len(cast(seq_lens, I64), cp, rank, interleave), I32)
    pos, _, valid, ctx = token_positions(query_start_loc, seq_lens, slot_mapping)
    zero = const(0, I64)
    causal = cast(where(valid, local_len(ge.Add(pos, const(1, I64)), cp, rank, interleave), zero), I32)
    context = cast(where(valid, local_len(ctx, cp, rank, interleave), zero), I32)
    return slots, seq, causal, context


def convert_quant_cache_write(new: Tensor, cache: Tensor, scale_cache: Tensor, slot_mapping: Tensor,
                              static_scale: Any = None, meta_outputs: Any = None):
    # The quantisation as GE primitives (core/ge_kv_quant.py), then two ScatterNdUpdates: the
    # int8 codes into the pages, the fp32 scales into the scale cache, at the same slots.
    refuse_static_scale("cp::quant_cache_write", static_scale)
    if cache.dtype != DataType.DT_INT8:
        raise NotImplementedError(
            f"cp::quant_cache_write: the GE converter writes int8 pages only (GE dtype {cache.dtype} here): "
            "FusedInferAttentionScore reads no fp8 key / value, so an fp8 cache has no GE reader. Fix: "
            "CPConfig(kv_cache_dtype='int8') on the NPU, or run the fp8 cache on CPU / CUDA (Triton)")
    quant_scatter_into(cache, scale_cache, new, slot_mapping)
    return None  # the caches are the ScatterNdUpdates' ref outputs, as cp::cache_write
