"""Execute a GE graph (torchair's serialised GraphDef) with torch on CPU.

One function per GE op type (`PRIMITIVES` here, the CANN fused ops in `cann_ops`,
the HCCL ops in `hccl`). Semantics are the TensorFlow-style ones GE's primitive
ops document (GE ops are TF-compatible by name: "Compatible with the TensorFlow
operator ..."), the fused ops' are CANN's operator pages (cited in cann_ops).

What the evaluator refuses or reports, instead of guessing:
- an op type it does not implement: `GEEvalError` naming it;
- an attribute value whose meaning it does not know (e.g. StridedSliceV2 masks);
- a documented precondition the graph violates (e.g. a ScatterPaKvCache slot out of
  range): `GEEvalError` naming the op and the rule's source;
- a ScatterNdUpdate index out of range (CANN's aclnnScatterNdUpdate page: unsupported):
  `GEEvalError`;
- a behaviour CANN leaves undocumented that the graph's values depend on (e.g.
  which of several rows scattered to one index wins): executed one way (or poisoned
  with NaN where any reading is wrong) and recorded in `Findings.uncertain` (op name,
  what, how many elements), which the check prints.

In-place ("ref") ops write into their `var` input tensor, as GE does for RefData and
TensorMove outputs, so the caches torchair hands in come back mutated.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable

import torch


class GEEvalError(RuntimeError):
    """The graph cannot be evaluated faithfully (unknown op / attribute, violated precondition)."""


@dataclass
class Findings:
    """Undocumented behaviours the values relied on, and documented constraints not met
    that do not change the values (tiling limits of the NPU kernels)."""

    uncertain: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    constraints: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def assume(self, what: str, count: int = 1) -> None:
        if count:
            self.uncertain[what] += int(count)

    def note(self, what: str) -> None:
        self.constraints[what] += 1


# ----------------------------------------------------------------------------- dtypes

# TensorDescriptor.dtype uses the proto enum (ge_ir.proto); op attributes (Cast's
# dst_type, Shape's dtype, ...) use ge::DataType (torchair.ge._ge_graph.DataType).
_BY_NAME = {"DT_FLOAT": torch.float32, "DT_FLOAT16": torch.float16, "DT_BF16": torch.bfloat16,
            "DT_INT8": torch.int8, "DT_UINT8": torch.uint8, "DT_INT16": torch.int16, "DT_INT32": torch.int32,
            "DT_INT64": torch.int64, "DT_BOOL": torch.bool, "DT_DOUBLE": torch.float64,
            "DT_UINT16": torch.uint16, "DT_UINT32": torch.uint32, "DT_UINT64": torch.uint64}


def _enum_maps() -> tuple[dict[int, torch.dtype], dict[int, torch.dtype]]:
    from torchair._ge_concrete_graph.ge_ir_pb2 import DataType as ProtoDT
    from torchair.ge._ge_graph import DataType as GeDT

    proto = {ProtoDT.Value(n): t for n, t in _BY_NAME.items()}
    ge = {getattr(GeDT, n): t for n, t in _BY_NAME.items() if hasattr(GeDT, n)}
    return proto, ge


PROTO_DTYPE, GE_DTYPE = _enum_maps()


def ge_dtype(code: int) -> torch.dtype:
    if code not in GE_DTYPE:
        raise GEEvalError(f"ge::DataType {code} has no torch dtype here")
    return GE_DTYPE[code]


# ----------------------------------------------------------------------------- attributes


def attr_value(a) -> Any:
    kind = a.WhichOneof("value")
    if kind == "s":
        return a.s.decode()
    if kind == "list":
        lv = a.list
        if lv.i:
            return list(lv.i)
        if lv.f:
            return list(lv.f)
        if lv.s:
            return [s.decode() for s in lv.s]
        if lv.b:
            return list(lv.b)
        if lv.dt:
            return list(lv.dt)
        return []
    if kind == "t":
        return const_tensor(a.t)
    return getattr(a, kind) if kind else None


def const_tensor(t) -> torch.Tensor:
    dtype = PROTO_DTYPE[t.desc.dtype]
    shape = list(t.desc.shape.dim)
    data = bytearray(t.data)
    if not data:
        return torch.zeros(shape, dtype=dtype)
    flat = torch.frombuffer(data, dtype=dtype).clone()
    return flat.reshape(shape)


def _is_control(ref: str) -> bool:
    """GE writes a control edge as `name:-1` (TF as `^name`)."""
    return ref.startswith("^") or ref.endswith(":-1")


def _input_names(op) -> list[str]:
    a = op.attr.get("_input_name_key")
    return [s.decode() for s in a.list.s] if a is not None else []


# ----------------------------------------------------------------------------- the evaluator

OpFn = Callable[["Ctx", list, dict], list]
PRIMITIVES: dict[str, OpFn] = {}


def op(*types: str):
    def register(fn: OpFn) -> OpFn:
        for t in types:
            PRIMITIVES[t] = fn
        return fn
    return register


@dataclass
class Ctx:
    """What an op function sees besides its inputs and attributes."""

    name: str
    type: str
    names: list[str]  # input names (`_input_name_key`), aligned with the inputs
    findings: Findings
    comm: Any  # hccl.Comm or None
    variant: dict[str, str]  # choices for undocumented behaviours (see cann_ops.VARIANTS)
    out_dtypes: list[torch.dtype | None]

    def fail(self, msg: str) -> GEEvalError:
        return GEEvalError(f"{self.type} {self.name!r}: {msg}")

    def named(self, inputs: list) -> dict[str, Any]:
        return dict(zip(self.names, inputs))


class Evaluator:
    """Evaluate `graph` (GraphDef) on `inputs` (indexed like the Data ops' `index`)."""

    def __init__(self, graph, *, comm=None, findings: Findings | None = None,
                 variant: dict[str, str] | None = None) -> None:
        from tools.ge_eval import cann_ops, hccl  # noqa: F401  (register their ops)

        self.graph = graph
        self.comm = comm
        self.findings = findings if findings is not None else Findings()
        self.variant = dict(variant or {})
        self.ops = {o.name: o for o in graph.op}

    def run(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        values: dict[str, list] = {}
        self._inputs = inputs

        def value_of(ref: str, reader):
            if not ref:
                return None
            name, _, idx = ref.rpartition(":")
            if name not in self.ops:
                raise GEEvalError(f"{reader.type} {reader.name!r} reads {ref!r}, which is not in the graph (a "
                                  "dangling input: GE's load would refuse the graph)")
            evaluate(name)
            outs = values[name]
            i = int(idx)
            if i >= len(outs):
                raise GEEvalError(f"{self.ops[name].type} {name!r} has no output {i}")
            return outs[i]

        def evaluate(name: str) -> None:
            if name in values:
                return
            o = self.ops[name]
            for ref in o.input:
                if _is_control(ref):
                    dep = ref[1:] if ref.startswith("^") else ref.rpartition(":")[0]
                    if dep not in self.ops:
                        raise GEEvalError(f"{o.type} {o.name!r} has a control edge from {dep!r}, which is not in "
                                          "the graph")
                    evaluate(dep)
            ins = [value_of(ref, o) for ref in o.input if not _is_control(ref)]
            values[name] = self._execute(o, ins)

        for o in self.graph.op:  # graph order; dependencies first
            evaluate(o.name)
        (net,) = [o for o in self.graph.op if o.type == "NetOutput"]
        return values[net.name]

    def _execute(self, o, ins: list) -> list:
        a = {k: attr_value(v) for k, v in o.attr.items() if not k.startswith("_") and not k.startswith("[")}
        if o.type == "Data" or o.type == "RefData":
            return [self._inputs[a["index"]]]
        if o.type == "Const":
            return [a["value"]]
        if o.type == "NetOutput":
            return list(ins)
        fn = PRIMITIVES.get(o.type)
        if fn is None:
            raise GEEvalError(f"GE op type {o.type} ({o.name!r}) is not implemented by the evaluator "
                              "(tools/ge_eval): add it from the op's documentation")
        out_dtypes = [PROTO_DTYPE.get(d.dtype) for d in o.output_desc]
        ctx = Ctx(o.name, o.type, _input_names(o), self.findings, self.comm, self.variant, out_dtypes)
        try:
            outs = fn(ctx, ins, a)
        except GEEvalError:
            raise
        except Exception as e:  # noqa: BLE001 - any op's crash is a failed graph that names the op
            # An input the op function did not foresee (a shape, a length) must fail the
            # graph with the op it reached, not escape as a bare torch error of the evaluator.
            raise ctx.fail(f"the evaluator's {o.type} raised {type(e).__name__}: {e} (inputs "
                           f"{[tuple(x.shape) if isinstance(x, torch.Tensor) else x for x in ins]})") from e
        return outs if isinstance(outs, list) else [outs]


# ----------------------------------------------------------------------------- primitive ops


def _ints(t) -> list[int]:
    if isinstance(t, torch.Tensor):
        return [int(v) for v in t.reshape(-1).tolist()]
    return [int(v) for v in (t if isinstance(t, (list, tuple)) else [t])]


def _binary(fn):
    def run(ctx, ins, a):
        x, y = ins
        return fn(x, y)
    return run


def _same(fn):
    """Elementwise op keeping x's dtype (GE's binary ops take equal input dtypes)."""
    def run(ctx, ins, a):
        x, y = ins
        if x.dtype != y.dtype:
            raise ctx.fail(f"input dtypes differ: {x.dtype} vs {y.dtype}")
        return fn(x, y).to(x.dtype)
    return run


PRIMITIVES.update({
    "Add": _same(torch.add), "Sub": _same(torch.sub), "Mul": _same(torch.mul),
    "Maximum": _same(torch.maximum), "Minimum": _same(torch.minimum),
    "Less": _binary(torch.lt), "LessEqual": _binary(torch.le), "Greater": _binary(torch.gt),
    "GreaterEqual": _binary(torch.ge), "Equal": _binary(torch.eq), "NotEqual": _binary(torch.ne),
    "LogicalAnd": _binary(torch.logical_and), "LogicalOr": _binary(torch.logical_or),
})


@op("Div", "RealDiv")
def _div(ctx, ins, a):
    x, y = ins
    if not x.is_floating_point():
        raise ctx.fail("integer Div (rounding undocumented here); the converters use FloorDiv")
    return torch.div(x, y).to(x.dtype)


@op("FloorDiv")
def _floordiv(ctx, ins, a):
    x, y = ins
    return torch.div(x, y, rounding_mode="floor").to(x.dtype)  # TF FloorDiv: floor(x / y)


@op("FloorMod")
def _floormod(ctx, ins, a):
    x, y = ins
    return torch.remainder(x, y).to(x.dtype)  # TF FloorMod: result has the sign of y


@op("Pow")
def _pow(ctx, ins, a):
    x, y = ins
    return torch.pow(x, y).to(x.dtype)


def _unary(fn):
    def run(ctx, ins, a):
        return fn(ins[0])
    return run


PRIMITIVES.update({
    "Exp": _unary(torch.exp), "Log": _unary(torch.log), "Rsqrt": _unary(torch.rsqrt), "Sqrt": _unary(torch.sqrt),
    "Sin": _unary(torch.sin), "Cos": _unary(torch.cos), "Abs": _unary(torch.abs), "Neg": _unary(torch.neg),
    "Round": _unary(torch.round),  # half to even, as TF Round and torch.round
    "IsFinite": _unary(torch.isfinite), "IsNan": _unary(torch.isnan), "LogicalNot": _unary(torch.logical_not),
    "Sigmoid": _unary(torch.sigmoid), "Tanh": _unary(torch.tanh), "Reciprocal": _unary(torch.reciprocal),
    "ZerosLike": _unary(torch.zeros_like), "OnesLike": _unary(torch.ones_like),
    "Identity": _unary(lambda x: x), "TensorMove": _unary(lambda x: x.clone()),
})


@op("Swish")
def _swish(ctx, ins, a):
    x = ins[0]
    return (x * torch.sigmoid(float(a.get("scale", 1.0)) * x)).to(x.dtype)


@op("Muls")
def _muls(ctx, ins, a):
    return (ins[0] * float(a["value"])).to(ins[0].dtype)


@op("Adds")
def _adds(ctx, ins, a):
    return (ins[0] + float(a["value"])).to(ins[0].dtype)


@op("Cast")
def _cast(ctx, ins, a):
    return ins[0].to(ge_dtype(a["dst_type"]))


@op("Bitcast")
def _bitcast(ctx, ins, a):
    return ins[0].view(ge_dtype(a["type"]))


@op("SelectV2", "Select")
def _select(ctx, ins, a):
    cond, x, y = ins
    return torch.where(cond.bool(), x, y).to(x.dtype)


@op("ClipByValue")
def _clip(ctx, ins, a):
    x, lo, hi = ins
    return torch.minimum(torch.maximum(x, lo), hi).to(x.dtype)


@op("Shape")
def _shape(ctx, ins, a):
    return torch.tensor(list(ins[0].shape), dtype=ge_dtype(a.get("dtype", 3)))


@op("Reshape")
def _reshape(ctx, ins, a):
    x, shape = ins
    if a.get("axis", 0) != 0 or a.get("num_axes", -1) != -1:
        raise ctx.fail(f"partial Reshape (axis={a.get('axis')}, num_axes={a.get('num_axes')}) not implemented")
    dims = _ints(shape)
    if 0 in dims and x.numel() != 0:
        raise ctx.fail(f"shape {dims} holds 0 (TF: a literal 0, not 'copy')")
    return x.reshape(dims)


@op("Unsqueeze")
def _unsqueeze(ctx, ins, a):
    x = ins[0]
    out_rank = x.dim() + len(a["axes"])
    for ax in sorted(d % out_rank for d in a["axes"]):
        x = x.unsqueeze(ax)
    return x


@op("Squeeze", "SqueezeV2")
def _squeeze(ctx, ins, a):
    x = ins[0]
    axes = a.get("axis", [])
    axes = [axes] if isinstance(axes, int) else list(axes)
    if not axes:
        return x.squeeze()
    for ax in sorted((d % x.dim() for d in axes), reverse=True):
        if x.shape[ax] != 1:
            raise ctx.fail(f"squeezing axis {ax} of size {x.shape[ax]}")
        x = x.squeeze(ax)
    return x


@op("Pack")
def _pack(ctx, ins, a):
    return torch.stack(ins, dim=int(a.get("axis", 0)))


@op("ConcatV2")
def _concat(ctx, ins, a):
    *xs, dim = ins
    return torch.cat(xs, dim=int(_ints(dim)[0]))


@op("ConcatV2D")
def _concat_d(ctx, ins, a):
    return torch.cat(ins, dim=int(a["concat_dim"]))


def _gather_axis(ctx, x, idx, axis):
    idx = idx.long()
    n = x.shape[axis]
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= n):
        raise ctx.fail(f"index out of range [0, {n}) on axis {axis}: [{int(idx.min())}, {int(idx.max())}] "
                       "(GatherV2 documents no negative or out-of-range indices)")
    moved = x.movedim(axis, 0)[idx]  # [idx..., rest...]
    return moved.movedim(list(range(idx.dim())), list(range(axis, axis + idx.dim())))


@op("GatherV2")
def _gather_v2(ctx, ins, a):
    x, idx, axis = ins
    if a.get("batch_dims", 0):
        raise ctx.fail(f"batch_dims {a['batch_dims']} not implemented")
    return _gather_axis(ctx, x, idx, int(_ints(axis)[0]) % x.dim())


@op("Gather")
def _gather(ctx, ins, a):
    x, idx = ins
    if a.get("batch_dims", 0):
        raise ctx.fail(f"batch_dims {a['batch_dims']} not implemented")
    return _gather_axis(ctx, x, idx, 0)


@op("GatherElements")
def _gather_elements(ctx, ins, a):
    x, idx = ins
    return torch.gather(x, int(a.get("dim", 0)), idx.long())


@op("GatherNd")
def _gather_nd(ctx, ins, a):
    x, idx = ins
    k = idx.shape[-1]
    flat = idx.reshape(-1, k).long()
    bounds = torch.tensor(list(x.shape[:k]))
    if flat.numel() and not bool(((flat >= 0) & (flat < bounds)).all()):
        raise ctx.fail(f"index out of range of {tuple(x.shape[:k])} (negative_index_support is "
                       f"{a.get('negative_index_support', False)})")
    return x[tuple(flat[:, i] for i in range(k))].reshape(*idx.shape[:-1], *x.shape[k:])


@op("Slice")
def _slice(ctx, ins, a):
    x, offsets, size = ins
    off, sz = _ints(offsets), _ints(size)
    idx = []
    for d, (o, s) in enumerate(zip(off, sz)):
        end = x.shape[d] if s == -1 else o + s
        if o < 0 or end > x.shape[d]:
            raise ctx.fail(f"slice [{o}, {end}) outside axis {d} of size {x.shape[d]}")
        idx.append(slice(o, end))
    return x[tuple(idx)]


@op("StridedSliceV2")
def _strided_slice_v2(ctx, ins, a):
    x, begin, end, axes, strides = (ins + [None, None])[:5]
    for m in ("begin_mask", "end_mask", "ellipsis_mask", "new_axis_mask", "shrink_axis_mask"):
        if a.get(m, 0):
            raise ctx.fail(f"{m}={a[m]} not implemented")
    b, e = _ints(begin), _ints(end)
    ax = _ints(axes) if axes is not None else list(range(len(b)))
    st = _ints(strides) if strides is not None else [1] * len(b)
    idx = [slice(None)] * x.dim()
    for bi, ei, ai, si in zip(b, e, ax, st):
        n = x.shape[ai]
        bi = max(bi + n, 0) if bi < 0 else min(bi, n)  # TF clamps begin / end into the axis
        ei = max(ei + n, 0) if ei < 0 else min(ei, n)
        idx[ai % x.dim()] = slice(bi, ei, si)
    return x[tuple(idx)]


@op("Transpose")
def _transpose(ctx, ins, a):
    return ins[0].permute(_ints(ins[1]))


@op("TransposeD")
def _transpose_d(ctx, ins, a):
    return ins[0].permute(a["perm"])


@op("MatMul", "MatMulV2")
def _matmul(ctx, ins, a):
    x1, x2 = ins[0], ins[1]
    bias = ins[2] if len(ins) > 2 else None
    if a.get("transpose_x1"):
        x1 = x1.transpose(-1, -2)
    if a.get("transpose_x2"):
        x2 = x2.transpose(-1, -2)
    out = x1 @ x2
    return (out if bias is None else out + bias).to(x1.dtype)


@op("BatchMatMul", "BatchMatMulV2")
def _bmm(ctx, ins, a):
    x1, x2 = ins[0], ins[1]
    if a.get("adj_x1"):
        x1 = x1.transpose(-1, -2)
    if a.get("adj_x2"):
        x2 = x2.transpose(-1, -2)
    return torch.matmul(x1, x2).to(x1.dtype)


def _reduce(fn):
    def run(ctx, ins, a):
        x = ins[0]
        axes = _ints(ins[1]) if len(ins) > 1 else list(a.get("axes", []))
        if not axes:
            axes = list(range(x.dim()))
        keep = bool(a.get("keep_dims", False))
        return fn(x, [d % max(x.dim(), 1) for d in axes], keep)
    return run


def _amax(x, axes, keep):
    return torch.amax(x, dim=axes, keepdim=keep)


def _prod(x, axes, keep):
    for d in sorted(axes, reverse=True):
        x = torch.prod(x, dim=d, keepdim=keep)
    return x


PRIMITIVES.update({
    "ReduceSum": _reduce(lambda x, d, k: torch.sum(x, dim=d, keepdim=k, dtype=x.dtype)),
    "ReduceSumD": _reduce(lambda x, d, k: torch.sum(x, dim=d, keepdim=k, dtype=x.dtype)),
    "ReduceMean": _reduce(lambda x, d, k: torch.mean(x, dim=d, keepdim=k)),
    "ReduceMeanD": _reduce(lambda x, d, k: torch.mean(x, dim=d, keepdim=k)),
    "ReduceMax": _reduce(_amax), "ReduceMaxD": _reduce(_amax),
    "ReduceProd": _reduce(_prod), "ReduceProdD": _reduce(_prod),
    "ReduceAny": _reduce(lambda x, d, k: torch.amax(x.bool().to(torch.uint8), dim=d, keepdim=k).bool()),
    "ReduceAll": _reduce(lambda x, d, k: torch.amin(x.bool().to(torch.uint8), dim=d, keepdim=k).bool()),
})


@op("Range")
def _range(ctx, ins, a):
    start, limit, delta = ins
    return torch.arange(start.item(), limit.item(), delta.item(), dtype=start.dtype)


@op("PadV3")
def _pad_v3(ctx, ins, a):
    # CANN PadV3 IR (torch-npu 2.13.0's ge_apis): paddings_contiguous true = [begin0, end0,
    # begin1, end1, ...] from dim 0; mode "constant" pads with constant_values (0 if absent).
    x, paddings, value = (ins + [None])[:3]
    if a.get("mode", "constant") != "constant" or not a.get("paddings_contiguous", True):
        raise ctx.fail(f"mode {a.get('mode')!r} / paddings_contiguous {a.get('paddings_contiguous')} not implemented")
    p = _ints(paddings)
    if len(p) != 2 * x.dim() or min(p) < 0:
        raise ctx.fail(f"paddings {p} for a rank-{x.dim()} input: want 2 * rank non-negative entries")
    torch_order = [v for d in reversed(range(x.dim())) for v in (p[2 * d], p[2 * d + 1])]
    return torch.nn.functional.pad(x, torch_order, value=0 if value is None else value.item())


@op("Fill")
def _fill(ctx, ins, a):
    dims, value = ins
    return torch.full(_ints(dims), value.item(), dtype=value.dtype)


@op("SplitD")
def _split_d(ctx, ins, a):
    x = ins[0]
    n, dim = int(a["num_split"]), int(a["split_dim"])
    if x.shape[dim] % n:
        raise ctx.fail(f"axis {dim} of size {x.shape[dim]} does not split into {n}")
    return list(torch.chunk(x, n, dim=dim))


@op("SplitV")
def _split_v(ctx, ins, a):
    x, sizes, dim = ins
    s = _ints(sizes)
    d = int(_ints(dim)[0])
    if -1 in s:
        s[s.index(-1)] = x.shape[d] - (sum(s) + 1)
    return list(torch.split(x, s, dim=d))


@op("Sort")
def _sort(ctx, ins, a):
    x = ins[0]
    if not a.get("stable", False):
        ctx.findings.assume(f"{ctx.type}: stable=false, order of equal keys undefined; a stable sort is used")
    values, indices = torch.sort(x, dim=int(a.get("axis", -1)), descending=bool(a.get("descending", False)),
                                 stable=True)
    return [values, indices.to(torch.int32)]


@op("SearchSorted")
def _search_sorted(ctx, ins, a):
    seq, values = ins[0], ins[1]
    if len(ins) > 2 and ins[2] is not None:
        raise ctx.fail("sorter not implemented")
    if seq.numel() > 1 and not bool((seq[..., 1:] >= seq[..., :-1]).all()):
        raise ctx.fail("sorted_sequence is not sorted")
    out = torch.searchsorted(seq, values, right=bool(a.get("right", False)))
    return out.to(ge_dtype(a.get("dtype", 9)))


@op("Cumsum")
def _cumsum(ctx, ins, a):
    x, axis = ins
    if a.get("exclusive") or a.get("reverse"):
        raise ctx.fail("exclusive / reverse Cumsum not implemented")
    return torch.cumsum(x, dim=int(_ints(axis)[0]), dtype=x.dtype)


@op("LayerNormV4")
def _layer_norm_v4(ctx, ins, a):
    named = ctx.named(ins)
    x, shape = named["x"], _ints(named["normalized_shape"])
    eps = float(a.get("epsilon", 1e-5))
    dims = list(range(x.dim() - len(shape), x.dim()))
    xf = x.float()
    mean = xf.mean(dim=dims, keepdim=True)
    rstd = torch.rsqrt(xf.var(dim=dims, unbiased=False, keepdim=True) + eps)
    y = (xf - mean) * rstd
    if named.get("gamma") is not None:
        y = y * named["gamma"].float()
    if named.get("beta") is not None:
        y = y + named["beta"].float()
    return [y.to(x.dtype), mean, rstd]


@op("ScatterNdUpdate")
def _scatter_nd_update(ctx, ins, a):
    var, indices, updates = ins
    k = indices.shape[-1]
    idx = indices.reshape(-1, k).long()
    upd = updates.reshape(idx.shape[0], *var.shape[k:])
    bounds = torch.tensor(list(var.shape[:k]))
    inside = ((idx >= 0) & (idx < bounds)).all(dim=1)
    if not bool(inside.all()):
        # CANN's aclnnScatterNdUpdate page (CANN 8.0.RC3 .. 8.2.RC1.alpha002, hiascend.com
        # aolapi/context/aclnnScatterNdUpdate.md): "indices中的索引数据不支持越界", out-of-range
        # indices are unsupported: what an NPU does with them is undefined, so refused.
        row = int((~inside).nonzero()[0, 0])
        raise ctx.fail(f"{int((~inside).sum())} of {idx.shape[0]} indices out of range of {tuple(var.shape[:k])}, "
                       f"e.g. row {row}: {idx[row].tolist()} (CANN's aclnnScatterNdUpdate page: out-of-range "
                       f"indices are unsupported; a cache write must route slot -1 in range, e.g. to the "
                       f"scratch block, ops/core/scratch_block.py)")
    uniq, counts = torch.unique(idx, dim=0, return_counts=True)
    var[tuple(idx[:, i] for i in range(k))] = upd.to(var.dtype)
    if bool((counts > 1).any()):
        # Several rows on one index: the pages give no order, so the written value is
        # undefined. Poisoned with NaN: a later read of it (attention over a slot two
        # tokens wrote) fails the value check; an unread scratch slot does not.
        # int8 (quantised KV pages, decision 70): -128, a code the quantiser never writes (it
        # clamps to +-127), and the slot's fp32 scale (written by the same slots) is NaN.
        if var.dtype == torch.int8:
            poison = -128
        elif not var.is_floating_point():
            raise ctx.fail("duplicate indices into a non-float var (the order of the writes is undocumented)")
        else:
            poison = float("nan")
        dup = uniq[counts > 1]
        var[tuple(dup[:, i] for i in range(k))] = poison
        ctx.findings.assume("ScatterNdUpdate: an index written by several rows holds an undefined value "
                            "(NaN here, -128 in int8; the scratch block's slot in the GE cache writes)",
                            int(dup.shape[0]))
    return var
