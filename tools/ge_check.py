"""torchair GE-graph check: FX -> GE conversion of every cp:: op and the DCP model graphs, on CPU.

Runs torchair's real Python (the converter registry, `get_npu_backend` in
`max-autotune` mode, the FX -> GE conversion, its GE graph passes and dumps) with
one thing replaced: torchair's C++ extension `torchair.core._torchair`, by the
stand-in `tools.torchair_standin` (pinned to torch-npu 2.13.0). The
stand-in receives the serialised GE graph at `load`; the check reads it back and
asserts op types, attributes and shapes. Nothing is compiled by GE or run.

1. op graphs: each cp:: op alone (bf16, the shapes of a small GQA / MLA layer),
   through `torchair.get_npu_backend`: the op's GE op types and key attributes;
2. model graphs: the example models (Qwen3-style GQA, DeepSeek-style MLA) at tp = 4,
   dcp = 1 and dcp = 2 with both merges (`ag_rs`, `a2a`), compiled on 4 gloo ranks
   (ranks 0 and 1, one DCP group, build graphs), and the DeepSeek-V3.2-style sparse
   (SFA) model at tp = dcp = 2 (SFA DCP needs dcp == tp) on 2 more gloo ranks,
   through the public path (`cp_compile.compile_model(..., lowering="torchair",
   torchair_mode="max-autotune")` after `init_parallel`), so the DCP group names
   are real: every FX node has a converter, the GE graph holds the expected ops,
   and the collectives are HCCL ops on the DCP group (rank list and size), the TP
   all-reduce on the TP group;
3. `--with-unconverted-op` adds a graph with an op that has no converter: the
   check must then fail (the negative case the tests run);
4. by value (issue 21): every GE graph is run on CPU by `tools.ge_eval` (in place of
   the stand-in's `run`) and compared with its FX graph on the same inputs, outputs
   and mutated caches, every rank, under both readings of FIA's empty-row LSE
   (`tools/ge_eval/probe.py`); `CP_COMPILE_GE_CONVERTERS=DIR` loads converter copies
   from DIR (each at its path below ops/: `catalog.converter_modules`) instead of the
   library's (the mutation test).

    TORCH_DEVICE_BACKEND_AUTOLOAD=0 .venv-torchair/bin/python -m tools.ge_check [--json F] [--dump DIR]

(`TORCH_DEVICE_BACKEND_AUTOLOAD=0`: with torch-npu installed, `import torch` would
otherwise try to load torch_npu, which needs CANN.) Exit status: 0 all converted
and as expected, 1 something failed, 2 not runnable here.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from tools import torchair_standin as standin

# Key attributes read off each GE op type (what the table prints and the tests assert).
KEY_ATTRS = {
    "FusedInferAttentionScore": ("num_heads", "num_key_value_heads", "input_layout", "softmax_lse_flag",
                                 "block_size", "sparse_mode", "scale"),
    "ScatterPaKvCache": ("cache_mode",),
    "ScatterNdUpdate": ("use_locking",),
    "AttentionUpdate": ("update_type", "sp"),
    "LightningIndexer": ("layout_query", "layout_key", "sparse_count", "sparse_mode"),
    "SparseFlashAttention": ("layout_query", "layout_kv", "sparse_mode", "scale_value", "return_softmax_lse"),
    "Sort": ("axis", "descending", "stable"),
    "HcomAllGather": ("group", "rank_size"),
    "HcomReduceScatter": ("group", "rank_size", "reduction"),
    "HcomAllToAllV": ("group",),
    "HcomAllReduce": ("group", "reduction"),
}
HCOM = ("HcomAllGather", "HcomReduceScatter", "HcomAllToAllV", "HcomAllReduce")


@dataclass
class GraphResult:
    name: str  # "op:<op>" or "<model> dcp=<n> <merge>"
    status: str  # ok | failed
    message: str = ""
    fx_nodes: int = 0  # call_function nodes torchair converted
    fx_targets: dict[str, int] = field(default_factory=dict)
    ge_ops: dict[str, int] = field(default_factory=dict)
    attrs: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # GE op type -> attrs of each instance
    io: dict[str, list[str]] = field(default_factory=dict)  # inputs / outputs -> "name: dtype[shape]"
    groups: list[dict[str, Any]] = field(default_factory=list)  # HCCL ops: type, group, rank_list, rank_size
    expected_ranks: list[int] = field(default_factory=list)  # the DCP group's ranks (dcp > 1)
    tp_ranks: list[int] = field(default_factory=list)  # the TP group's ranks
    seconds: float = 0.0
    rank: int = 0
    text: str = ""  # the GE graph rendered by `render` (written under --dump, not into --json)
    # GE graph (tools/ge_eval) vs FX graph on the same inputs: one row per output / mutated
    # input and reading of an undocumented behaviour (tools/ge_eval/probe.py).
    values: list[dict[str, Any]] = field(default_factory=list)
    uncertain: dict[str, int] = field(default_factory=dict)  # undocumented behaviours the values rely on
    constraints: dict[str, int] = field(default_factory=dict)  # documented NPU limits the CI shapes miss
    mutation: str = ""  # under --mutations: the converter copy this op graph ran with


# ----------------------------------------------------------------------------- GE graph reading


def _attr_value(a) -> Any:
    kind = a.WhichOneof("value")
    if kind == "s":
        return a.s.decode()
    if kind == "list":
        return list(a.list.i) or [s.decode() for s in a.list.s] or list(a.list.f)
    return getattr(a, kind) if kind else None


def _desc(d) -> str:
    from torchair._ge_concrete_graph.ge_ir_pb2 import DataType

    shape = list(d.shape.dim) if d.HasField("shape") else []
    return f"{d.name}: {DataType.Name(d.dtype)}{shape}"


def read_graph(graph, result: GraphResult) -> None:
    result.ge_ops = dict(Counter(op.type for op in graph.op))
    # What GE is handed: the graph inputs (Data) and outputs (NetOutput) with dtype and
    # shape (-1 = dynamic). Shapes inside the graph are GE's InferShape (CANN), not here.
    result.io["inputs"] = [_desc(op.output_desc[0]) for op in graph.op if op.type == "Data"]
    result.io["outputs"] = [_desc(d) for op in graph.op if op.type == "NetOutput" for d in op.input_desc]
    result.text = render(graph)
    for op in graph.op:
        if op.type in KEY_ATTRS:
            result.attrs.setdefault(op.type, []).append(
                {k: _attr_value(op.attr[k]) for k in KEY_ATTRS[op.type] if k in op.attr})
        if op.type in HCOM:
            group = op.attr["group"].s.decode()
            m = re.search(r"rank_list=([\d,]+)", group)
            result.groups.append(dict(type=op.type, group=group,
                                      rank_list=[int(x) for x in m.group(1).split(",")] if m else None,
                                      rank_size=op.attr["rank_size"].i if "rank_size" in op.attr else None))


def render(graph) -> str:
    """The GE graph as text, one op per line: `name = Type(inputs) {attrs}`, in graph order.
    Internal attrs (leading `_`) are left out; Data / NetOutput lines carry dtype and shape."""
    lines = [f"# GE graph {graph.name}: {len(graph.op)} ops (torchair FX -> GE, as handed to GE's load)"]
    for op in graph.op:
        attrs = {k: _attr_value(v) for k, v in sorted(op.attr.items()) if not k.startswith("_") and
                 not k.startswith("[")}
        for k, v in attrs.items():
            if isinstance(v, bytes) or (isinstance(v, str) and len(v) > 80):
                attrs[k] = "..."
        desc = ""
        if op.type == "Data":
            desc = " -> " + _desc(op.output_desc[0])
        elif op.type == "NetOutput":
            desc = " <- " + ", ".join(_desc(d) for d in op.input_desc)
        text = ", ".join(op.input)
        lines.append(f"{op.name} = {op.type}({text})" + (f" {attrs}" if attrs else "") + desc)
    return "\n".join(lines) + "\n"


class _FxRecorder:
    """Records the FX graph torchair converts (GeConcreteGraph.save_fx_graph) to count its nodes."""

    def __init__(self) -> None:
        from torchair._ge_concrete_graph.fx2ge_converter import GeConcreteGraph

        self.graphs: list[Any] = []
        original = GeConcreteGraph.save_fx_graph
        recorder = self

        def save_fx_graph(graph_self, gm):
            recorder.graphs.append(gm)
            return original(graph_self, gm)

        GeConcreteGraph.save_fx_graph = save_fx_graph


def fx_targets(gm) -> Counter:
    from torchair._ge_concrete_graph.fx2ge_converter import _get_converter

    targets: Counter = Counter()
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        target = n.args[0] if str(n.target) == "auto_functionalized_v2" else n.target
        name = str(target)
        try:
            has = _get_converter(target) is not None
        except (KeyError, AttributeError):
            has = False
        targets[name if has or name.startswith("<") else f"{name} (NO CONVERTER)"] += 1
    return targets


def compile_and_load(fn: Callable[[], Any], name: str, recorder: _FxRecorder, rank: int = 0) -> GraphResult:
    """Run `fn` (which calls a torch.compile'd function once) and read the GE graph it loaded."""
    from tools.ge_eval import probe

    result = GraphResult(name=name, status="failed", rank=rank)
    start = time.perf_counter()
    loaded = len(standin.STATE.graphs)
    fx_seen = len(recorder.graphs)
    compared = len(probe.RESULTS)
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the conversion error is the result
        result.message = f"{type(e).__name__}: {e}"[:3000]
    comparisons = probe.RESULTS[compared:]
    for c in comparisons:
        result.values += [dict(r, graph=c.graph) for r in c.rows]
        for k, v in c.uncertain.items():
            result.uncertain[k] = result.uncertain.get(k, 0) + v
        for k, v in c.constraints.items():
            result.constraints[k] = result.constraints.get(k, 0) + v
    value_failures = [f"{c.graph}: {f}" for c in comparisons for f in c.failures()]
    if value_failures and not result.message:
        result.message = f"{name}: GE graph differs from the FX graph by value: " + "; ".join(value_failures)[:3000]
    elif not comparisons and not result.message:
        result.message = "no GE graph was run (the value check compared nothing)"
    result.seconds = time.perf_counter() - start
    new = standin.STATE.graphs[loaded:]
    for gm in recorder.graphs[fx_seen:]:
        t = fx_targets(gm)
        result.fx_targets.update({k: result.fx_targets.get(k, 0) + v for k, v in t.items()})
        result.fx_nodes += sum(t.values())
    if new and not result.message:
        if len(new) != 1:
            result.message = f"expected one GE graph, got {len(new)}"
        else:
            read_graph(new[0].graph, result)
            result.status = "ok"
    elif not new and not result.message:
        result.message = "no GE graph was loaded"
    return result


# ----------------------------------------------------------------------------- converters under test

# A folder holding (mutated) copies of the GE converter modules, each at its path below
# ops/ (`paged/ge.py`, `core/ge_util.py`, ...: `catalog.module_path`): loaded in place of
# the library's converter modules, for the mutation test (tests/ops/test_ge_value_mutations.py).
CONVERTERS_ENV = "CP_COMPILE_GE_CONVERTERS"


def load_converters(folder: str | None) -> None:
    """Import the converter modules (`cp_compile.ops.core.catalog.converter_modules()`:
    helpers first) from `folder` under their library names (so the library's
    `register_converters` finds them already imported)."""
    if not folder:
        return
    import importlib.util

    from cp_compile.ops.core.catalog import converter_modules, module_path

    for full in converter_modules():
        spec = importlib.util.spec_from_file_location(full, Path(folder) / module_path(full))
        module = importlib.util.module_from_spec(spec)
        sys.modules[full] = module
        spec.loader.exec_module(module)


# ----------------------------------------------------------------------------- op graphs


def op_cases() -> dict[str, tuple[Callable[..., Any], tuple]]:
    """One small call per cp:: op: bf16 activations, fp32 LSEs, the example models' head layouts."""
    bf = torch.bfloat16
    T, B, NB, BS, nb = 6, 2, 8, 4, 4
    Hq, Hkv, D = 8, 2, 64
    H, L, R = 8, 64, 16
    qsl = torch.tensor([0, 2, 5], dtype=torch.int32)
    seq = torch.tensor([5, 7], dtype=torch.int32)
    slots = torch.tensor([3, 4, 9, 10, 11, -1])
    table = torch.zeros(B, nb, dtype=torch.int32)
    kv_lens = torch.tensor([4, 5, 5, 6, 7, 0], dtype=torch.int32)
    mine, other = torch.randn(T, 2 * Hq), torch.randn(T, 2 * Hq)  # per-token LSEs of two DCP ranks
    mine[4:] = float("-inf")
    other[5] = float("-inf")
    cp = torch.ops.cp
    from cp_compile.ops.core.scratch_block import mark_scratch_block

    def cache(make, *shape, dtype):
        # A paged cache as allocate_kv_cache(..., scratch_block=True) makes it: its last
        # page (block NB - 1, named by no table and no slot here) is the scratch block
        # the GE cache writes send slot -1 to (ops/core/scratch_block.py).
        t = make(*shape, dtype=dtype)
        mark_scratch_block(t)
        return t

    return {
        "cp::dcp_localize_metadata": (lambda s, q, sl: cp.dcp_localize_metadata(s, q, sl, 2, 1, 1, BS),
                                      (slots, qsl, seq)),
        # Returns the cache's pages (the scratch block, where slot -1 lands, is undefined).
        "cp::cache_write": (lambda n, c, s: (cp.cache_write(n, c, s), c[:-1])[1],
                            (torch.randn(T, Hkv, D, dtype=bf), cache(torch.zeros, NB, BS, Hkv, D, dtype=bf), slots)),
        "cp::paged_attention_lse": (lambda q, k, v, t, qs, kl: cp.paged_attention_lse(q, k, v, t, qs, kl, 0.125),
                                    (torch.randn(T, Hq, D, dtype=bf), cache(torch.randn, NB, BS, Hkv, D, dtype=bf),
                                     cache(torch.randn, NB, BS, Hkv, D, dtype=bf), table, qsl, kv_lens)),
        "cp::mla_partial_attention": (lambda qn, qp, c, t, qs, kl: cp.mla_partial_attention(qn, qp, c, t, qs, kl, 0.1),
                                      (torch.randn(T, H, L, dtype=bf), torch.randn(T, H, R, dtype=bf),
                                       cache(torch.randn, NB, BS, L + R, dtype=bf), table, qsl, kv_lens)),
        # Empty shards: token 4 has no key on this rank, token 5 (padding) on none.
        "cp::lse_rescale": (lambda o, l, la: cp.lse_rescale(o, l, la),
                            (torch.randn(T, 2 * Hq, D, dtype=bf), mine, torch.cat([mine.T, other.T]))),
        "cp::lse_combine": (lambda o, l: cp.lse_combine(o, l),
                            (torch.randn(2, Hq, T, D, dtype=bf), torch.stack([mine[:, :Hq].T, other[:, :Hq].T]))),
        "cp::gqa_paged_attention": (
            lambda q, k, v, kc, vc, s, t, sl, qs: cp.gqa_paged_attention(q, k, v, kc, vc, s, t, sl, qs, 0.125),
            (torch.randn(T, Hq, D, dtype=bf), torch.randn(T, Hkv, D, dtype=bf), torch.randn(T, Hkv, D, dtype=bf),
             cache(torch.zeros, NB, BS, Hkv, D, dtype=bf), cache(torch.zeros, NB, BS, Hkv, D, dtype=bf), slots, table,
             seq, qsl)),
        "cp::mla_attention": (
            lambda qn, qp, c, kp, kv, s, t, sl, qs: cp.mla_attention(qn, qp, c, kp, kv, s, t, sl, qs, 0.1),
            (torch.randn(T, H, L, dtype=bf), torch.randn(T, H, R, dtype=bf), torch.randn(T, L, dtype=bf),
             torch.randn(T, R, dtype=bf), cache(torch.zeros, NB, BS, L + R, dtype=bf), slots, table, seq, qsl)),
        "cp::lightning_indexer": (
            lambda qi, ki, w, ic, s, t, sl, qs: cp.lightning_indexer(qi, ki, w, ic, s, t, sl, qs, 4),
            (torch.randn(T, 4, 32, dtype=bf), torch.randn(T, 32, dtype=bf), torch.randn(T, 4, dtype=bf),
             cache(torch.zeros, NB, BS, 32, dtype=bf), slots, table, seq, qsl)),
        "cp::sparse_mla_attention": (
            lambda qn, qp, c, kp, kv, s, t, sl, qs, ti: cp.sparse_mla_attention(qn, qp, c, kp, kv, s, t, sl, qs, ti,
                                                                                0.1),
            (torch.randn(T, H, L, dtype=bf), torch.randn(T, H, R, dtype=bf), torch.randn(T, L, dtype=bf),
             torch.randn(T, R, dtype=bf), cache(torch.zeros, NB, BS, L + R, dtype=bf), slots, table, seq, qsl,
             torch.zeros(T, 4, dtype=torch.int32))),
        "cp::sparse_mla_partial_attention": (
            lambda qn, qp, c, t, qs, i: cp.sparse_mla_partial_attention(qn, qp, c, t, qs, i, 0.1),
            (torch.randn(T, 2 * H, L, dtype=bf), torch.randn(T, 2 * H, R, dtype=bf),
             cache(torch.randn, NB, BS, L + R, dtype=bf), table, qsl, torch.zeros(T, 4, dtype=torch.int32))),
        "cp::dcp_sparse_indices": (lambda i: cp.dcp_sparse_indices(i, 2, 1, 1, BS),
                                   (torch.tensor([[0, 5, 2, -1]] * T, dtype=torch.int32),)),
        # DSA-CP: rank 1's 3 rows of the 6 tokens at tp 2 (rows 3..5, the last one padding).
        "cp::lightning_indexer_topk_rows": (
            lambda qi, ic, w, t, sl, qs: cp.lightning_indexer_topk_rows(qi, ic, w, t, sl, qs, 2, 1, 4),
            (torch.randn(3, 4, 32, dtype=bf), cache(torch.zeros, NB, BS, 32, dtype=bf), torch.randn(3, 4, dtype=bf),
             table, seq, qsl)),
        "cp::sparse_mla_rows_attention": (
            lambda qn, qp, c, t, sl, qs, i: cp.sparse_mla_rows_attention(qn, qp, c, t, sl, qs, i, 2, 1, 0.1),
            (torch.randn(3, H, L, dtype=bf), torch.randn(3, H, R, dtype=bf),
             cache(torch.randn, NB, BS, L + R, dtype=bf), table, seq, qsl, torch.zeros(3, 4, dtype=torch.int32))),
        # W8A8 o_proj (ops/quant/ops.py): int8 K-major weight [in, out], two activation groups
        # (the DSA-CP full-weight o_proj at tp 2).
        "cp::w8a8_dynamic_linear": (
            lambda x, w, s, o: cp.w8a8_dynamic_linear(x, w, s, o, 2),
            (torch.randn(T, 64, dtype=bf), torch.randint(-127, 128, (64, 32), dtype=torch.int8), torch.rand(32),
             torch.zeros(32, dtype=torch.int32))),
        "cp::w8a8_static_linear": (
            lambda x, w, s, o, qb, dq: cp.w8a8_static_linear(x, w, s, o, qb, dq),
            (torch.randn(T, 64, dtype=bf), torch.randint(-127, 128, (64, 32), dtype=torch.int8),
             torch.tensor([0.02, 0.03]), torch.tensor([1, -2], dtype=torch.int32),
             torch.zeros(2, 32, dtype=torch.int32), torch.rand(2, 32))),
        # MLAPO (ops/mla_preprocess/ops.py): q-LoRA 32, H heads of nope 16 + rope R, latent L, cache write;
        # then into a second cache in HF DeepSeek-V2's bf16 rope (rotated in fp32, issue 27).
        "cp::mla_preprocess": (
            lambda x, qa, qan, qb, kva, kvn, wuk, c, s, kv, sl, kv2: cp.mla_preprocess(
                x, qa, None, None, qan, qb, None, None, kva, None, None, kvn, wuk, c, s, kv, sl, 1e-6, 1e-6,
                "interleave") + cp.mla_preprocess(
                x, qa, None, None, qan, qb, None, None, kva, None, None, kvn, wuk, c, s, kv2, sl, 1e-6, 1e-6,
                "interleave_fp32"),
            (torch.randn(T, 64, dtype=bf), torch.randn(32, 64, dtype=bf), torch.ones(32, dtype=bf),
             torch.randn(H * (16 + R), 32, dtype=bf), torch.randn(L + R, 64, dtype=bf), torch.ones(L, dtype=bf),
             torch.randn(H, 16, L, dtype=bf), torch.rand(T, R // 2), torch.rand(T, R // 2),
             cache(torch.zeros, NB, BS, L + R, dtype=bf), slots, cache(torch.zeros, NB, BS, L + R, dtype=bf))),
        # Not a cp op: torchair's aten.constant_pad_nd converter refuses a symbolic pad,
        # ops/core/ge_aten_pad.py converts it (PadV3), as the DSA-CP prefill graph's token pad
        # needs (ops/parallel/dsa_cp.pad_tokens). Compiled with dynamic shapes (DYNAMIC_CASES):
        # the token dim's pad (2 * ceil(T / 2) - T, pad_tokens' formula at tp 2) is a SymInt;
        # the other dims' pads are static.
        "aten::constant_pad_nd": (lambda x: torch.nn.functional.pad(
            x, (1, 2, 0, 0, 0, (x.shape[0] + 1) // 2 * 2 - x.shape[0]), value=0.5),
                                  (torch.randn(7, 3, 4, dtype=bf),)),
    }


# Op cases compiled with dynamic shapes (the others are static).
DYNAMIC_CASES = {"aten::constant_pad_nd"}
# Op graphs whose GE path rounds through bf16 where the FX kernel stays in fp32: compared
# with bf16's tolerance, for the reason given.
BF16_PATHS = {"cp::lse_combine": (torch.bfloat16, "AttentionUpdate's out has localOut's dtype (bf16 here; the page "
                                                  "allows fp32 only on Atlas A3)")}


def _unconverted_op():
    """A custom op with no GE converter (negative case)."""
    if not hasattr(torch.ops, "cp_check") or not hasattr(torch.ops.cp_check, "unconverted"):
        @torch.library.custom_op("cp_check::unconverted", mutates_args=())
        def unconverted(x: torch.Tensor) -> torch.Tensor:
            return x * 2

        @unconverted.register_fake
        def _(x):
            return torch.empty_like(x)
    return torch.ops.cp_check.unconverted.default


def _torchair_backend(dump: str | None):
    import torchair

    cfg = torchair.CompilerConfig()
    cfg.mode = "max-autotune"
    if dump:
        cfg.debug.graph_dump.type = "pbtxt"
        cfg.debug.graph_dump.path = dump
    return torchair.get_npu_backend(compiler_config=cfg)


def run_op_graphs(recorder: _FxRecorder, dump: str | None, with_unconverted: bool,
                  only: list[str] | None = None) -> list[GraphResult]:
    results = []
    # Every op the project defines (an op listed here but not defined yet is skipped).
    cases = {k: v for k, v in op_cases().items() if not k.startswith("cp::") or hasattr(torch.ops.cp, k[4:])}
    if with_unconverted:
        op = _unconverted_op()
        cases["cp_check::unconverted"] = (lambda x: op(x) + 1, (torch.randn(4, 4, dtype=torch.bfloat16),))
    if only:
        cases = {k: v for k, v in cases.items() if k in only or (with_unconverted and k == "cp_check::unconverted")}
    from tools.ge_eval import probe

    for name, (fn, args) in cases.items():
        torch._dynamo.reset()
        compiled = torch.compile(fn, backend=_torchair_backend(dump), fullgraph=True, dynamic=name in DYNAMIC_CASES)
        probe.TOLERANCE_DTYPE = BF16_PATHS.get(name, (None, ""))[0]
        results.append(compile_and_load(lambda: compiled(*args), f"op:{name}", recorder))
        probe.TOLERANCE_DTYPE = None
    return results


def run_mutations(spec: str, recorder: _FxRecorder) -> list[GraphResult]:
    """Each (name, converter folder, op) of the JSON list `spec` in turn, in this process:
    the folder's converter modules replace the registered ones (torchair's registry is a
    dict keyed by op: registering again overrides), then that op's graph is checked.
    One process for every mutation (tests/ops/test_ge_value_mutations.py): one torch and
    torchair import instead of one per mutation."""
    from cp_compile.ops.core import ge_registry as ge_pkg

    results = []
    for name, folder, op in json.loads(Path(spec).read_text()):
        load_converters(folder)
        ge_pkg._registered.clear()
        ge_pkg.register_converters()
        for r in run_op_graphs(recorder, None, False, [op]):
            r.mutation = name
            results.append(r)
    return results


# ----------------------------------------------------------------------------- model graphs (4 gloo ranks)

MODEL_CONFIGS = [("gqa", 1, "ag_rs"), ("gqa", 2, "ag_rs"), ("gqa", 2, "a2a"),
                 ("mla", 1, "ag_rs"), ("mla", 2, "ag_rs"), ("mla", 2, "a2a")]
# tp = 4 on 4 gloo ranks, so the DCP groups ({0, 1}, {2, 3}) differ from the TP group
# ({0, 1, 2, 3}) and a collective on the wrong group shows in its rank list. Ranks 0
# and 1 (one DCP group) build graphs; ranks 2 and 3 only take part in creating the
# process groups (graph building issues no collective).
MODEL_WORLD = 4
BUILDING_RANKS = (0, 1, 2, 3)  # all: the value check runs the TP all-reduce, which needs every rank
# SFA DCP needs dcp == tp, which the tp = 4 world cannot give at dcp = 2: its own world
# of 2 ranks (both build; the DCP group is the TP group).
# The DSA-CP prefill graph (tp = 2, W8A8 o_proj through the o_proj pass). Its token pad is
# `F.pad` by a symbolic amount -> aten.constant_pad_nd with a tensor pad, which torchair's own
# converter refuses: ops/core/ge_aten_pad.py converts it (PadV3); the check runs a second step of
# another token-count parity with error_on_recompile (a torch.cat of zero rows instead of the
# pad would guard on the pad being 0: a recompile per parity).
SFA_CONFIGS = [("sfa", 2, "ag_rs"), ("sfa", 1, "dsa_cp")]
SFA_WORLD = 2


def _model(kind: str, tp: int, tp_rank: int, tp_group, w8a8: bool = False):
    # Imported after the stand-in is in place (as is cp_compile, whose kernel registry probes torch_npu).
    from examples.models.deepseek_mla import DeepseekMLAConfig, DeepseekMLAModel
    from examples.models.deepseek_sfa import DeepseekSFAConfig, DeepseekSFAModel
    from examples.models.qwen3 import Qwen3Config, Qwen3Model

    torch.manual_seed(0)
    if kind == "gqa":
        cfg = Qwen3Config(vocab_size=128, hidden_size=128, num_layers=1, num_heads=8, num_kv_heads=1, head_dim=64,
                          intermediate_size=128)
        return Qwen3Model(cfg, tp, tp_rank, tp_group).to(torch.bfloat16).eval()
    if kind == "sfa":
        cfg = DeepseekSFAConfig(vocab_size=128, hidden_size=128, num_layers=1, num_heads=8, q_lora_rank=64,
                                kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
                                intermediate_size=128, index_n_heads=4, index_head_dim=32, index_topk=4)
        if w8a8:  # static W8A8 o_proj, two input groups (the o_proj pass's full-weight linear)
            from examples.models.quant import W8A8Config

            cfg.o_proj_quant = W8A8Config("static", input_scales=(0.05, 0.08), input_offsets=(2, -3))
        return DeepseekSFAModel(cfg, tp, tp_rank, tp_group).to(torch.bfloat16).eval()
    cfg = DeepseekMLAConfig(vocab_size=128, hidden_size=128, num_layers=1, num_heads=8, kv_lora_rank=64,
                            qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, intermediate_size=128)
    return DeepseekMLAModel(cfg, tp, tp_rank, tp_group).to(torch.bfloat16).eval()


def _rank_main(rank: int, world: int, configs: list, dump: str | None) -> list[dict]:
    standin.install()
    import cp_compile
    from cp_compile.metadata import BlockAllocator
    from tools.ge_eval import hccl, probe

    load_converters(os.environ.get(CONVERTERS_ENV))
    probe.install(hccl.Comm())

    recorder = _FxRecorder()
    if dump:
        os.environ["CP_COMPILE_GE_DUMP"] = os.path.join(dump, f"rank{rank}")
    out = []
    for kind, dcp, merge in configs:
        torch._dynamo.reset()
        dsa = merge == "dsa_cp"
        cfg = cp_compile.CPConfig(tensor_parallel_size=world, decode_context_parallel_size=dcp, block_size=4,
                                  **(dict(enable_dsa_cp=True) if dsa else dict(dcp_merge=merge)))
        state = cp_compile.init_parallel(cfg, device="cpu")
        if rank not in BUILDING_RANKS:
            cp_compile.destroy_parallel()
            continue
        try:
            model = _model(kind, world, state.layout.tp.rank, state.tp_group, w8a8=dsa)
            cache = cp_compile.allocate_kv_cache(cfg, model.kv_cache_spec(), 16, dtype=torch.bfloat16,
                                                 attention=model.attention_spec(), scratch_block=True)
            compiled = cp_compile.compile_model(model, lowering="torchair", torchair_mode="max-autotune")
            layers = cache.layers if not cache.replicated else \
                [layer + (index,) for layer, index in zip(cache.layers, cache.replicated)]
            alloc = BlockAllocator(16, cfg.virtual_block_size)
            meta = cp_compile.build_attention_metadata([(0, 5), (0, 3)], alloc, num_padding_tokens=2,
                                                       max_blocks_per_req=4)
            ids = torch.zeros(10, dtype=torch.long)
            name = f"{kind} tp={world} dcp={dcp}" + (f" {merge}" if dcp > 1 or dsa else "")

            def step():
                with torch.no_grad():
                    # SFA: each layer's tuple also holds its replicated indexer cache.
                    compiled(ids, meta.positions, layers, meta)
                    if dsa:
                        # DSA-CP pads the token dim to tp * ceil(T / tp) (aten.constant_pad_nd of
                        # a symbolic amount, ops/core/ge_aten_pad.py): a second chunk of the same
                        # requests with an odd T (7: pad 1, the first step's 10: pad 0) must
                        # reuse the graph. A recompile raises here, and a second GE graph fails
                        # compile_and_load ("expected one GE graph").
                        second = cp_compile.build_attention_metadata([(5, 4), (3, 3)], alloc, max_blocks_per_req=4)
                        with torch._dynamo.config.patch(error_on_recompile=True):
                            compiled(torch.zeros(7, dtype=torch.long), second.positions, layers, second)

            # A bf16 model: every layer's activations are bf16 on both paths, rounded at
            # different points (GE's decompositions vs the FX kernels).
            probe.TOLERANCE_DTYPE = torch.bfloat16
            r = compile_and_load(step, name, recorder, rank)
            probe.TOLERANCE_DTYPE = None
            import torch.distributed as dist

            r.expected_ranks = dist.get_process_group_ranks(state.dcp_group) if dcp > 1 else []
            r.tp_ranks = dist.get_process_group_ranks(state.tp_group)
            out.append(asdict(r))
        finally:
            cp_compile.destroy_parallel()
    return out


def run_model_graphs(dump: str | None, configs=None) -> list[GraphResult]:
    from cp_compile.testing.multirank import run_on_ranks

    configs = configs or MODEL_CONFIGS + SFA_CONFIGS
    dense = [c for c in configs if c[0] != "sfa"]
    sfa = [c for c in configs if c[0] == "sfa"]
    per_rank = run_on_ranks(_rank_main, MODEL_WORLD, dense, dump, timeout=600) if dense else []
    per_rank += run_on_ranks(_rank_main, SFA_WORLD, sfa, dump, timeout=600) if sfa else []
    return [GraphResult(**r) for rank in per_rank for r in rank]


# ----------------------------------------------------------------------------- expectations


# aten ops the project converts itself (ops/core/ge_aten_pad.py): the GE ops their op graph
# must hold (GatherV2 builds PadV3's paddings from the symbolic pad: not torchair's converter).
ATEN_GE_OPS = {"aten::constant_pad_nd": ("PadV3", "GatherV2")}


def expect_op(r: GraphResult, op: str) -> list[str]:
    from cp_compile.ops.core.ge_registry import GE_OPS

    problems = [f"{op}: GE graph lacks {t}" for t in {**GE_OPS, **ATEN_GE_OPS}[op] if t not in r.ge_ops]
    if any("NO CONVERTER" in k for k in r.fx_targets):
        problems.append(f"FX nodes without converter: {[k for k in r.fx_targets if 'NO CONVERTER' in k]}")
    fia = r.attrs.get("FusedInferAttentionScore", [])
    for a in fia:
        if not a.get("softmax_lse_flag", False) and op != "cp::gqa_paged_attention" and op != "cp::mla_attention":
            problems.append(f"{op}: FusedInferAttentionScore without softmax_lse_flag")
    if op == "cp::paged_attention_lse" and fia and (fia[0].get("num_heads"), fia[0].get("num_key_value_heads"),
                                                    fia[0].get("input_layout"), fia[0].get("block_size")) != (
            8, 2, "BSND", 4):
        problems.append(f"{op}: FusedInferAttentionScore attrs {fia[0]}")
    if op == "cp::mla_partial_attention" and fia and (fia[0].get("num_heads"), fia[0].get("num_key_value_heads")) \
            != (8, 1):
        problems.append(f"{op}: FusedInferAttentionScore attrs {fia[0]}")
    if op == "cp::sparse_mla_partial_attention" and \
            not r.attrs.get("SparseFlashAttention", [{}])[0].get("return_softmax_lse"):
        problems.append(f"{op}: SparseFlashAttention without return_softmax_lse")
    if op == "cp::dcp_sparse_indices" and r.attrs.get("Sort", [{}])[0].get("stable") is not True:
        problems.append(f"{op}: the compaction sort is not stable")
    if op == "cp::lse_combine" and r.attrs.get("AttentionUpdate", [{}])[0] != {"update_type": 1, "sp": 2}:
        problems.append(f"{op}: AttentionUpdate attrs {r.attrs.get('AttentionUpdate')}")
    return problems


def expect_model(r: GraphResult) -> list[str]:
    problems = []
    if any("NO CONVERTER" in k for k in r.fx_targets):
        problems.append(f"FX nodes without converter: {[k for k in r.fx_targets if 'NO CONVERTER' in k]}")
    kind = r.name.split()[0]
    dcp = int(re.search(r"dcp=(\d)", r.name).group(1))
    layers = 1  # the example models are built with one decoder layer: the graph of one DCP layer
    if kind == "sfa" and r.name.endswith("dsa_cp"):
        return problems + _expect_dsa_cp_model(r)
    if kind == "sfa":
        return problems + _expect_sfa_model(r, dcp, layers)
    fia = r.attrs.get("FusedInferAttentionScore", [])
    if len(fia) != layers:
        problems.append(f"{len(fia)} FusedInferAttentionScore, want {layers}")
    tp = len(r.tp_ranks)
    heads = 8 // tp  # this rank's query heads (the example models have 8)
    want_heads = heads * dcp  # DCP attends the gathered heads of the group
    for a in fia:
        if a.get("num_heads") != want_heads:
            problems.append(f"FusedInferAttentionScore num_heads {a.get('num_heads')}, want {want_heads}")
        if dcp > 1 and not a.get("softmax_lse_flag"):
            problems.append("DCP partial attention without softmax_lse_flag")
    allreduce = [g for g in r.groups if g["type"] == "HcomAllReduce"]
    if not allreduce:
        problems.append("no HcomAllReduce (TP all-reduce) in the graph")
    for g in allreduce:
        if g["rank_list"] != r.tp_ranks:
            problems.append(f"TP all-reduce on group {g['group']!r}, want TP ranks {r.tp_ranks}")
    for a in fia:
        if (a.get("input_layout"), a.get("block_size")) != ("BSND", 4):
            problems.append(f"FusedInferAttentionScore layout / block size {a}")
    for a in r.attrs.get("AttentionUpdate", []):
        if a != {"update_type": 1, "sp": dcp}:
            problems.append(f"AttentionUpdate {a}, want update_type 1, sp {dcp}")
    if dcp == 1:
        if any(g["type"] != "HcomAllReduce" for g in r.groups):
            problems.append(f"dcp=1 graph has DCP collectives: {r.groups}")
        want = {"ScatterNdUpdate": layers * (2 if kind == "gqa" else 1)}  # k and v / the MLA latent
    else:
        merge = r.name.split()[-1]
        q_gathers = 1  # GQA gathers q; MLA one fused [q_nope | q_pe]
        want = {"ScatterNdUpdate": layers * (2 if kind == "gqa" else 1)}
        if merge == "ag_rs":
            want.update(HcomAllGather=layers * (q_gathers + 1), HcomReduceScatter=layers)
        else:
            want.update(HcomAllGather=layers * q_gathers, HcomAllToAllV=layers, AttentionUpdate=layers)
        for g in r.groups:
            if g["type"] == "HcomAllReduce":
                continue
            if g["rank_list"] != r.expected_ranks:
                problems.append(f"{g['type']} on group {g['group']!r}, want DCP ranks {r.expected_ranks}")
            if g["rank_size"] not in (None, dcp):
                problems.append(f"{g['type']} rank_size {g['rank_size']}, want {dcp}")
    for op_type, n in want.items():
        if r.ge_ops.get(op_type, 0) != n:
            problems.append(f"{r.ge_ops.get(op_type, 0)} {op_type}, want {n}")
    return problems


def _expect_dsa_cp_model(r: GraphResult) -> list[str]:
    """The DSA-CP prefill graph (tp = 2, W8A8 o_proj): the row-shard indexer and sparse
    MLA, the o_proj pass's full-weight W8A8 linear (QuantBatchMatmulV3, two groups)."""
    want = ("LightningIndexer", "SparseFlashAttention", "QuantBatchMatmulV3", "HcomAllToAllV")
    return [f"DSA-CP graph lacks {t}" for t in want if not r.ge_ops.get(t)]


def _expect_sfa_model(r: GraphResult, dcp: int, layers: int) -> list[str]:
    """The sparse model at tp = dcp: the indexer stays whole (LightningIndexer over the
    replicated cache, its own key write), sparse MLA becomes the SFA DCP blocks."""
    problems = []
    sfa = r.attrs.get("SparseFlashAttention", [])
    want = {"LightningIndexer": layers, "SparseFlashAttention": layers,
            "ScatterNdUpdate": 2 * layers}  # indexer keys + latent
    if dcp > 1:
        want.update(Sort=layers, GatherElements=layers, HcomAllGather=2 * layers, HcomReduceScatter=layers)
        if any(not a.get("return_softmax_lse") for a in sfa):
            problems.append("DCP sparse attention without return_softmax_lse")
        if any(a.get("stable") is not True for a in r.attrs.get("Sort", [])):
            problems.append("the top-k compaction sort is not stable")
        for g in r.groups:
            if g["rank_list"] != r.expected_ranks:
                problems.append(f"{g['type']} on group {g['group']!r}, want DCP ranks {r.expected_ranks}")
    if r.ge_ops.get("FusedInferAttentionScore", 0):
        problems.append("sparse model graph holds a dense FusedInferAttentionScore")
    if not any(g["type"] == "HcomAllReduce" for g in r.groups):
        problems.append("no HcomAllReduce (TP all-reduce) in the graph")
    for op_type, n in want.items():
        if r.ge_ops.get(op_type, 0) != n:
            problems.append(f"{r.ge_ops.get(op_type, 0)} {op_type}, want {n}")
    return problems


# ----------------------------------------------------------------------------- report


def table(results: list[GraphResult]) -> str:
    rows = []
    for r in results:
        main = {k: v for k, v in r.ge_ops.items() if k in KEY_ATTRS or k in ("FloorDiv", "SelectV2", "ReduceMaxD")}
        attrs = "; ".join(f"{t}{r.attrs[t][0]}" for t in r.attrs)
        rows.append(f"{r.name:<36} {r.status:<6} fx={r.fx_nodes:<4} ge={sum(r.ge_ops.values()):<5} "
                    f"{json.dumps(main)}  {attrs}" + (f"\n    {r.message[:600]}" if r.message else ""))
    return "\n".join(rows)


def values_table(results: list[GraphResult]) -> str:
    """GE vs FX by value: per graph and rank, the worst max abs diff of each output /
    mutated input over the readings of the undocumented behaviours."""
    lines = ["graph | rank | compared: max abs diff (dtype) | undocumented behaviours relied on"]
    for r in results:
        worst: dict[str, tuple[float, str, bool]] = {}
        for v in r.values:
            d, dtype, ok = worst.get(v["what"], (0.0, v["dtype"], True))
            worst[v["what"]] = (max(d, v["max_abs_diff"]), v["dtype"], ok and v["ok"])
        cells = ", ".join(f"{k} {d:.2g} ({t}){'' if ok else ' FAIL'}" for k, (d, t, ok) in worst.items())
        lines.append(f"{r.name} | {r.rank} | {cells or 'none'} | {len(r.uncertain)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--dump", help="write torchair's GE graph dumps (pbtxt) under this folder")
    parser.add_argument("--with-unconverted-op", action="store_true",
                        help="add an op that has no GE converter (the check must fail)")
    parser.add_argument("--ops-only", action="store_true", help="skip the model graphs (4 gloo ranks)")
    parser.add_argument("--op", action="append", help="only this op graph (e.g. cp::cache_write); implies --ops-only")
    parser.add_argument("--mutations", help="a JSON list of [name, converter folder, op]: each op graph with its "
                        "folder's converters, in turn (implies --ops-only)")
    parser.add_argument("--model", action="append", help="only this model graph, KIND:DCP:MERGE (e.g. sfa:2:ag_rs); "
                        "skips the op graphs")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        standin.install()
        from cp_compile.ops.core.ge_registry import GE_OPS, register_converters
        from tools.ge_eval import probe

        load_converters(os.environ.get(CONVERTERS_ENV))
        register_converters()
        probe.install()
    except (RuntimeError, ImportError) as e:
        print(f"torchair GE check not runnable here: {e}", file=sys.stderr)
        return 2
    recorder = _FxRecorder()
    if args.mutations:
        results = run_mutations(args.mutations, recorder)
    else:
        results = [] if args.model else run_op_graphs(recorder, args.dump, args.with_unconverted_op, args.op)
    for r in results:
        op = r.name[3:]
        if r.status == "ok" and (op in GE_OPS or op in ATEN_GE_OPS):
            problems = expect_op(r, op)
            if problems:
                r.status, r.message = "failed", "; ".join(problems)
    if not args.ops_only and not args.op and not args.mutations:
        chosen = [(k, int(d), m) for k, d, m in (x.split(":") for x in args.model)] if args.model else None
        models = run_model_graphs(args.dump, chosen)
        for r in models:
            if r.status == "ok":
                problems = expect_model(r)
                if problems:
                    r.status, r.message = "failed", "; ".join(problems)
        results += models
    # Ops declared without a GE converter (`ge=Absent(why)`: cp::pcp_token_index, a marker the
    # PCP pass removes before any lowering) are not expected to convert.
    from cp_compile.ops.core.catalog import OPS
    from cp_compile.ops.core.spec import Absent

    no_ge = {d.name for d in OPS if isinstance(d.ge, Absent)}
    defined = sorted(f"cp::{n}" for n in dir(torch.ops.cp) if not n.startswith("_") and
                     isinstance(getattr(torch.ops.cp, n), torch._ops.OpOverloadPacket) and f"cp::{n}" not in no_ge)
    uncovered = sorted(set(defined) - set(GE_OPS)) if not (args.op or args.model or args.mutations) else []
    failed = [r for r in results if r.status != "ok"]
    summary = dict(op_graphs=sum(r.name.startswith("op:cp::") for r in results),
                   aten_op_graphs=sum(r.name.startswith("op:aten::") for r in results),
                   model_graphs=sum(not r.name.startswith("op:") for r in results),
                   failed=len(failed), fx_nodes=sum(r.fx_nodes for r in results),
                   ge_ops=sum(sum(r.ge_ops.values()) for r in results),
                   hccl_ops=sum(len([g for g in r.groups]) for r in results),
                   cp_ops_defined=len(defined), cp_ops_without_converter=uncovered,
                   seconds=time.perf_counter() - start)
    print(table(results))
    print("\n" + values_table(results))
    print(f"\ntorchair GE check: {summary['op_graphs']} cp op graphs (+ {summary['aten_op_graphs']} aten), "
          f"{summary['model_graphs']} model graphs "
          f"(ranks {list(BUILDING_RANKS)} of {MODEL_WORLD}; SFA on {SFA_WORLD}), "
          f"{summary['fx_nodes']} FX nodes converted, {summary['ge_ops']} GE ops, "
          f"{summary['hccl_ops']} HCCL ops; {summary['failed']} failed; {summary['cp_ops_defined']} cp ops, "
          f"without converter: {uncovered or 'none'}; {summary['seconds']:.1f} s")
    if args.dump:
        Path(args.dump).mkdir(parents=True, exist_ok=True)
        for r in results:
            if r.text:
                slug = re.sub(r"[^A-Za-z0-9_.=-]+", "_", r.name)
                Path(args.dump, f"{slug}.rank{r.rank}.ge.txt").write_text(r.text)
    if args.json:
        rows = [{k: v for k, v in asdict(r).items() if k != "text"} for r in results]
        Path(args.json).write_text(json.dumps(dict(summary=summary, results=rows), indent=1))
    return 1 if failed or uncovered else 0


if __name__ == "__main__":
    sys.exit(main())
