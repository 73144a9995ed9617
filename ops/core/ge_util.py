"""Small helpers shared by the GE converters of every op family (imported only when torchair is).

Shapes: converters see torchair `Tensor`s whose `.meta` is the FX fake value; a
dim is a Python int when static and a SymInt when dynamic (the token count T,
the batch size B). `shape_of` builds a GE int64 shape vector from static ints and
`Shape(x)[axis]` gathers for the dynamic dims, so reshapes stay exact under
dynamic shapes.
"""

from __future__ import annotations

from typing import Sequence, Union

import torch
from torchair._ge_concrete_graph import ge_apis as ge
from torchair.ge._ge_graph import DataType, Tensor

I64 = DataType.DT_INT64
I32 = DataType.DT_INT32
F32 = DataType.DT_FLOAT

Dim = Union[int, tuple[Tensor, int]]  # a static size, or (tensor, axis): that tensor's size on that axis


def dims(x: Tensor) -> list[Dim]:
    """x's dims: ints where static, (x, axis) where dynamic."""
    return [d if isinstance(d, int) else (x, i) for i, d in enumerate(x.meta.shape)]


def shape_vec(parts: Sequence[Dim]) -> Tensor | list[int]:
    """A shape for Reshape/Fill: a plain list when all static, else an int64 GE vector."""
    if all(isinstance(p, int) for p in parts):
        return [int(p) for p in parts]
    pieces = []
    for p in parts:
        if isinstance(p, int):
            pieces.append(ge.Const([int(p)], dtype=I64))
        else:
            t, axis = p
            pieces.append(ge.GatherV2(ge.Shape(t, dtype=I64), ge.Const([axis], dtype=I64), ge.Const(0, dtype=I64)))
    return ge.ConcatV2(pieces, ge.Const(0, dtype=I32), N=len(pieces))


def reshape(x: Tensor, parts: Sequence[Dim]) -> Tensor:
    shape = shape_vec(parts)
    if isinstance(shape, list):
        shape = ge.Const(shape, dtype=I64)
    return ge.Reshape(x, shape)


def cast(x: Tensor, dtype: int) -> Tensor:
    return x if x.dtype == dtype else ge.Cast(x, dst_type=dtype)


def const(value, dtype: int) -> Tensor:
    return ge.Const(value, dtype=dtype)


def ge_dtype(dtype: torch.dtype) -> int:
    from torchair._ge_concrete_graph.utils import torch_type_to_ge_type

    return torch_type_to_ge_type(dtype)


def request_of_token(query_start_loc: Tensor, num_tokens_of: Tensor) -> tuple[Tensor, Tensor]:
    """(request index [T] int64 clamped to B-1, valid [T] bool: token < qsl[-1]).

    req[t] = #{b : qsl[b+1] <= t} (the searchsorted of layout.request_index), as a
    broadcast compare and a sum: GE primitives only, no data-dependent shapes.
    """
    qsl = cast(query_start_loc, I64)
    t = ge.Range(const(0, I64), ge.GatherV2(ge.Shape(num_tokens_of, dtype=I64), const(0, I64), const(0, I64)),
                 const(1, I64))  # [T]
    ends = tail(qsl)  # qsl[1:]  [B]
    le = ge.Cast(ge.LessEqual(ge.Unsqueeze(ends, axes=[0]), ge.Unsqueeze(t, axes=[1])), dst_type=I64)  # [T, B]
    req = ge.ReduceSumD(le, axes=[1], keep_dims=False)  # [T]
    total = last(qsl)
    valid = ge.Less(t, total)
    nb = ge.Sub(ge.GatherV2(ge.Shape(qsl, dtype=I64), const(0, I64), const(0, I64)), const(2, I64))
    return ge.Minimum(req, nb), valid


def tail(v: Tensor) -> Tensor:
    """v[1:] of a 1-D tensor."""
    n = ge.GatherV2(ge.Shape(v, dtype=I64), const([0], I64), const(0, I64))
    return ge.Slice(v, const([1], I64), ge.Sub(n, const([1], I64)))


def last(v: Tensor) -> Tensor:
    """v[-1] of a 1-D tensor, as a scalar."""
    n = ge.GatherV2(ge.Shape(v, dtype=I64), const(0, I64), const(0, I64))
    return ge.GatherV2(v, ge.Sub(n, const(1, I64)), const(0, I64))


def head(v: Tensor) -> Tensor:
    """v[:-1] of a 1-D tensor."""
    n = ge.GatherV2(ge.Shape(v, dtype=I64), const([0], I64), const(0, I64))
    return ge.Slice(v, const([0], I64), ge.Sub(n, const([1], I64)))




def where(cond: Tensor, a: Tensor, b: Tensor) -> Tensor:
    return ge.SelectV2(cond, a, b)


def local_len(length: Tensor, cp: int, rank: int, interleave: int) -> Tensor:
    """ops/layout.local_len in GE int64 arithmetic."""
    base = ge.Mul(ge.FloorDiv(length, const(cp * interleave, I64)), const(interleave, I64))
    rest = ge.Sub(ge.Sub(length, ge.Mul(base, const(cp, I64))), const(rank * interleave, I64))
    return ge.Add(base, ge.Minimum(ge.Maximum(rest, const(0, I64)), const(interleave, I64)))


def token_positions(query_start_loc: Tensor, seq_lens: Tensor, like: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(pos [T], req [T], valid [T], ctx [T]) int64 as ops/layout.token_positions (pos/ctx unmasked)."""
    qsl = cast(query_start_loc, I64)
    req, valid = request_of_token(qsl, like)
    q_len = ge.Sub(tail(qsl), head(qsl))  # [B]
    ctx_b = ge.Sub(cast(seq_lens, I64), q_len)  # [B]
    ctx = ge.GatherV2(ctx_b, req, const(0, I64))  # [T]
    t = ge.Range(const(0, I64), ge.GatherV2(ge.Shape(like, dtype=I64), const(0, I64), const(0, I64)), const(1, I64))
    pos = ge.Add(ctx, ge.Sub(t, ge.GatherV2(qsl, req, const(0, I64))))
    return pos, req, valid, ctx


# ----------------------------------------------------------------------------- cache writes
# Every family that writes a paged cache in its GE graph (paged, sparse, mla_preprocess)
# scatters the same way; why the scratch block: paged/ge_cache.py.


def slot_indices(slot_mapping: Tensor, block_size: int) -> Tensor:
    """[T] slots -> [T, 2] (block, offset) int64 indices into a [NB, BS, ...] cache."""
    s = cast(slot_mapping, I64)
    bs = const(block_size, I64)
    return ge.Pack([ge.FloorDiv(s, bs), ge.FloorMod(s, bs)], N=2, axis=1)


def scratch_slot(cache: Tensor) -> Tensor:
    """The first slot of `cache`'s last page (its scratch block), int64 scalar."""
    nb, bs = cache.meta.shape[0], int(cache.meta.shape[1])
    if isinstance(nb, int):
        return const((nb - 1) * bs, I64)
    n = ge.GatherV2(ge.Shape(cache, dtype=I64), const(0, I64), const(0, I64))
    return ge.Mul(ge.Sub(n, const(1, I64)), const(bs, I64))


def scatter_into(cache: Tensor, new: Tensor, slot_mapping: Tensor) -> Tensor:
    """cache[slot // BS, slot % BS] = new[t], in place (the returned tensor is the ref output).

    A slot < 0 (writes nothing) goes to the scratch block, so every index is in range.
    """
    s = cast(slot_mapping, I64)
    s = where(ge.GreaterEqual(s, const(0, I64)), s, scratch_slot(cache))  # -1 -> the scratch block
    return ge.ScatterNdUpdate(cache, slot_indices(s, int(cache.meta.shape[1])), new)
