"""MLAPO pass: each MLA layer's pre-attention subgraph -> one `cp::mla_preprocess` node.

Two pipeline stages in this file (docs/mla_preprocess.md):

1. `MLAPreprocessPass` (first in the pipeline, on the single-device graph). For
   every `cp::mla_attention` / `cp::sparse_mla_attention` node it recognises the
   subgraph `cp::mla_preprocess` computes (`match_layer`, passes/mla_preprocess_match.py:
   the forms it takes, in the example models' and Hugging Face DeepSeek-V2 / V3
   layouts) and puts the op in its place (`rewrite_layer`). A layer that is not the
   op's (a bias, another rope, a different norm) is left as it is: the layer stays
   unfused, the pass's count says so and its warning names the reason (`NoMatch`). The
   attention's inputs are then read from the op, and the now unread unfused nodes are
   erased (with HF's per-head K expansion that only fed the ignored `key` argument).
   Every later pass sees the op's outputs where it saw the
   unfused values: DCP gathers them (the Q all-gather reads the op's q_abs / q_pe),
   PCP and DSA-CP run the op on the graph's own token rows.

2. `MLAPreprocessCacheWritePass` (after the parallel passes): where the latent the
   op returned is written to the cache by exactly one `cp::cache_write(cat([kv_c,
   k_pe]), cache, slots)` (DCP, SFA DCP, PCP decode: local slots; DSA-CP: global
   slots), the write moves into the op; on one device (dcp = pcp = 1) the attention
   op's own write moves into it and the attention becomes its no-write twin
   (`cp::mla_partial_attention` over causal lengths / `cp::sparse_mla_partial_attention`).
   A PCP prefill graph writes the PCP-gathered latents, not the op's, so it keeps its write.
   A quantised latent cache (kv_cache_dtype int8 / fp8, issue 39): the write is
   `cp::quant_cache_write(cat, cache, scale_cache, slots)` or `cp::mla_attention_quant`'s
   own; folding it turns the op into `cp::mla_preprocess_quant` (the same arguments with
   the scale cache after the cache), the attention into `cp::mla_partial_attention` with
   the scale cache.
"""

from __future__ import annotations

import operator
import warnings

import torch
import torch.fx as fx

import cp_compile.ops.mla_preprocess.ops  # noqa: F401  (registers cp::mla_preprocess)
from cp_compile.passes.context import CompileContext
from cp_compile.passes.base import CPPass
from cp_compile.passes.mla_preprocess_match import (LayerMatch, Linear, NoMatch, cat_pair, is_call, is_method,
                                                    match_layer, tensor_of)

cp = torch.ops.cp
_ATTENTION = (cp.mla_attention.default, cp.mla_attention, cp.sparse_mla_attention.default, cp.sparse_mla_attention,
              cp.mla_attention_quant.default, cp.mla_attention_quant)
_QUANT_ATTENTION = (cp.mla_attention_quant.default, cp.mla_attention_quant)
_PREPROCESS = (cp.mla_preprocess.default, cp.mla_preprocess)


# ----------------------------------------------------------------------------- rewriting


def _is_pure(n: fx.Node) -> bool:
    if n.op == "call_method":
        return not str(n.target).endswith("_")
    if n.op != "call_function":
        return False
    schema = getattr(n.target, "_schema", None)
    if schema is None and hasattr(n.target, "default"):
        schema = getattr(n.target.default, "_schema", None)
    if schema is not None and schema.is_mutable:
        return False
    return n.target is not torch._C._log_api_usage_once


def erase_unread(graph: fx.Graph, roots: list[fx.Node]) -> int:
    """Erase `roots` and their producers once nothing reads them (pure nodes only)."""
    work, erased = list(roots), set()
    while work:
        n = work.pop()
        if n in erased or n.users or not _is_pure(n):
            continue
        inputs = list(n.all_input_nodes)
        graph.erase_node(n)
        erased.add(n)
        work.extend(inputs)
    return len(erased)


def drop_unread_buffers(graph: fx.Graph) -> list[fx.Node]:
    """HF's per-head K (`key_states = new_empty(...)`, filled by `copy_` into slices)
    is only passed to the attention function, which ignores it: when nothing else
    reads the buffer, erase it and its fills; return what they read."""
    freed: list[fx.Node] = []
    for buf in [n for n in graph.nodes if is_method(n, "new_empty")]:
        slices = list(buf.users)
        fills = [u for s in slices for u in s.users]
        if not slices or not all(is_call(s, operator.getitem) for s in slices) \
                or not all(is_method(f, "copy_") and not f.users for f in fills) \
                or any(len(s.users) != 1 for s in slices):
            continue
        for f in fills:
            freed.extend(a for a in f.all_input_nodes if a not in slices)
            graph.erase_node(f)
        for s in slices:
            graph.erase_node(s)
        freed.extend(buf.all_input_nodes)
        graph.erase_node(buf)
    return freed


def _complex_parts(graph: fx.Graph, table: fx.Node) -> tuple[fx.Node, fx.Node]:
    """A complex table [..., R/2] -> its real and imaginary parts [T, R/2] (cos, sin)."""
    width = tensor_of(table).shape[-1]
    with graph.inserting_after(table):
        parts = graph.call_function(torch.view_as_real, (table,))  # [..., R/2, 2]
    out = []
    for i in (1, 0):
        with graph.inserting_after(parts):
            part = graph.call_function(operator.getitem, (parts, (Ellipsis, i)))
        with graph.inserting_after(part):
            out.insert(0, graph.call_method("reshape", (part, -1, width)))
    return out[0], out[1]


def _cos_sin_for_op(graph: fx.Graph, src: fx.Node, full_width: bool) -> fx.Node:
    """cos / sin as the op takes them: [T, R/2] (the example's [T, R/2], HF's [1, T, R/2] slice;
    HF's full-width rotate_half table [1, T, R]: its first half)."""
    t = tensor_of(src)
    width = t.shape[-1] // 2 if full_width else t.shape[-1]
    if full_width:
        with graph.inserting_after(src):
            src = graph.call_function(operator.getitem, (src, (Ellipsis, slice(None, width, None))))
    if t.dim() == 2 and not full_width:
        return src
    with graph.inserting_after(src):
        return graph.call_method("reshape", (src, -1, width))


def _flat_x(graph: fx.Graph, x: fx.Node) -> fx.Node:
    t = tensor_of(x)
    if t.dim() == 2:
        return x
    with graph.inserting_after(x):  # HF: [1, T, D]
        return graph.call_method("reshape", (x, -1, t.shape[-1]))


def rewrite_layer(graph: fx.Graph, m: LayerMatch) -> fx.Node:
    """Insert the op after the last of its inputs; the attention reads its outputs."""
    if m.complex_table:
        cos, sin = _complex_parts(graph, m.cos)
    else:
        cos, sin = _cos_sin_for_op(graph, m.cos, m.full_width), _cos_sin_for_op(graph, m.sin, m.full_width)
    x = _flat_x(graph, m.x)
    q_a = m.q_a or Linear(x, None)  # type: ignore[arg-type]
    inputs = [x, q_a.weight, q_a.scale, q_a.offset, m.q_a_norm, m.q_b.weight, m.q_b.scale, m.q_b.offset,
              m.kv_a.weight, m.kv_a.scale, m.kv_a.offset, m.kv_norm, m.w_uk, cos, sin]
    order = _order(graph)
    last = max((n for n in inputs if isinstance(n, fx.Node)), key=order.__getitem__)
    with graph.inserting_after(last):
        op = graph.call_function(cp.mla_preprocess.default,
                                 (*inputs, None, None, m.q_eps, m.kv_eps, m.rope_mode))
    outs = []
    with graph.inserting_after(op):
        for i in reversed(range(5)):
            outs.insert(0, graph.call_function(operator.getitem, (op, i)))
    old = list(m.attention.args[:4])
    for i, node in enumerate(old):
        m.attention.replace_input_with(node, outs[i])
    if m.q_resid is not None and tensor_of(m.q_resid).dim() == 2:  # [T, q_lora], the op's layout
        # Other readers (the DSA indexer) take the op's q_resid where it is already computed.
        pos = order[last]
        for user in list(m.q_resid.users):
            if order.get(user, -1) > pos and tensor_of(user) is not None:
                user.replace_input_with(m.q_resid, outs[4])
    erase_unread(graph, [n for n in old if isinstance(n, fx.Node)])
    return op


def _order(graph: fx.Graph) -> dict[fx.Node, int]:
    return {n: i for i, n in enumerate(graph.nodes)}


class _MLAPOStage(CPPass):
    """Both stages: enabled by the one config flag, which is all they read."""

    enabled_when = "enable_mla_preprocess (CPConfig)"

    @classmethod
    def is_enabled(cls, ctx: CompileContext) -> bool:
        return ctx.config.enable_mla_preprocess


class MLAPreprocessPass(_MLAPOStage):
    """Fuse each MLA layer's pre-attention subgraph into `cp::mla_preprocess`."""

    name = "mla_preprocess"

    def __call__(self, gm: fx.GraphModule) -> int:
        graph = gm.graph
        attentions = [n for n in graph.nodes if is_call(n, *_ATTENTION)]
        if not attentions:
            return 0
        erase_unread(graph, drop_unread_buffers(graph))
        count = 0
        reasons: dict[str, list[str]] = {}
        for node in attentions:
            try:
                m = match_layer(node)
            except NoMatch as e:
                reasons.setdefault(str(e), []).append(node.name)
                continue
            rewrite_layer(graph, m)
            count += 1
        if count < len(attentions):
            # Enabled but not (fully) applied: exact either way, but the user asked for the fusion
            # (issue 19: no silent no-op); each distinct reason once, with the attention nodes it holds for.
            why = "; ".join(f"[{', '.join(nodes)}] {r}" for r, nodes in reasons.items())
            warnings.warn(f"mla_preprocess: enable_mla_preprocess is on but {len(attentions) - count} of "
                          f"{len(attentions)} MLA attention layers in this graph do not match the pre-processing "
                          f"pattern (passes/mla_preprocess_match.py); those layers run unfused (exact, not fused): {why}",
                          stacklevel=2)
        if count:
            graph.lint()
            gm.recompile()
        return count


# ----------------------------------------------------------------------------- the cache write


def _output(op: fx.Node, i: int) -> fx.Node | None:
    return next((u for u in op.users if is_call(u, operator.getitem) and u.args[1] == i), None)


def _hoist_before(graph: fx.Graph, node: fx.Node, anchor: fx.Node, order: dict[fx.Node, int]) -> bool:
    """Move `node` and whatever it needs that comes after `anchor` to just before
    `anchor` (pure nodes whose inputs are all placeholders or earlier). False if
    something impure or dependent on `anchor` would have to move."""
    pos = order[anchor]
    need: list[fx.Node] = []

    def visit(n: fx.Node) -> bool:
        if order.get(n, -1) < pos or n in need:
            return True
        if n is anchor or not _is_pure(n) and not is_call(n, cp.dcp_localize_metadata.default):
            return False
        if not all(visit(a) for a in n.all_input_nodes):
            return False
        need.append(n)
        return True

    if not visit(node):
        return False
    for n in sorted(need, key=order.__getitem__):
        anchor.prepend(n)
    return True


def _write_into(graph: fx.Graph, op: fx.Node, cache: fx.Node, scale_cache: fx.Node | None,
                slots: fx.Node) -> fx.Node:
    """The op with its latent written to `cache` at `slots`: `cp::mla_preprocess` with the cache
    arguments filled, or (a quantised cache) its `cp::mla_preprocess_quant` twin in its place."""
    args = list(op.args)
    if scale_cache is None:
        args[15], args[16] = cache, slots
        op.args = tuple(args)
        return op
    with graph.inserting_before(op):
        twin = graph.call_function(cp.mla_preprocess_quant.default,
                                   (*args[:15], cache, scale_cache, slots, *args[17:]), dict(op.kwargs))
    twin.meta.update(op.meta)
    op.replace_all_uses_with(twin)
    graph.erase_node(op)
    return twin


def _static_scale(node: fx.Node, position: int, name: str) -> object:
    """The node's static-scale argument (positional or keyword), None when it has none."""
    if len(node.args) > position:
        return node.args[position]
    return node.kwargs.get(name)


def _fold_local_write(graph: fx.Graph, op: fx.Node, order: dict[fx.Node, int]) -> bool:
    """cache_write(cat([kv_c, k_pe], -1), cache, slots) of the op's own latent -> the op writes it
    (quant_cache_write(cat, cache, scale_cache, slots): its quantised twin does)."""
    kv_c, k_pe = _output(op, 2), _output(op, 3)
    if kv_c is None or k_pe is None:
        return False
    for cat in list(kv_c.users):
        if cat_pair(cat) != (kv_c, k_pe) or len(cat.users) != 1:
            continue
        write = next(iter(cat.users))
        if is_call(write, cp.cache_write.default, cp.cache_write) and write.args[0] is cat:
            cache, scale_cache, slots = write.args[1], None, write.args[2]
        elif is_call(write, cp.quant_cache_write.default, cp.quant_cache_write) and write.args[0] is cat:
            if _static_scale(write, 4, "static_scale") is not None:
                return False  # the fused write stores dynamic scales only: a static one stays unfused
            cache, scale_cache, slots = write.args[1], write.args[2], write.args[3]
        else:
            continue
        if not _hoist_before(graph, slots, op, order):
            return False
        _write_into(graph, op, cache, scale_cache, slots)
        graph.erase_node(write)
        graph.erase_node(cat)
        return True
    return False


def _fold_attention_write(graph: fx.Graph, op: fx.Node, causal: dict[tuple[fx.Node, ...], fx.Node]) -> bool:
    """One device: the attention op's write moves into the op; the attention becomes its no-write twin."""
    outs = [_output(op, i) for i in range(4)]
    attn = next((u for u in (outs[0].users if outs[0] is not None else ()) if is_call(u, *_ATTENTION)), None)
    if attn is None or list(attn.args[:4]) != outs:
        return False
    quant = is_call(attn, *_QUANT_ATTENTION)
    if quant and _static_scale(attn, 11, "kv_static_scale") is not None:
        return False  # a checkpoint's static latent scale (decision 71): the fused write stores dynamic ones
    if quant:  # (..., kv_cache, kv_scale_cache, slots, block_table, seq_lens, qsl, scale)
        cache, scale_cache = attn.args[4], attn.args[5]
        slots, block_table, seq_lens, qsl, softmax_scale = attn.args[6:11]
    else:
        cache, scale_cache = attn.args[4], None
        slots, block_table, seq_lens, qsl = attn.args[5:9]
        softmax_scale = attn.args[9]
    _write_into(graph, op, cache, scale_cache, slots)
    with graph.inserting_before(attn):
        if quant or is_call(attn, cp.mla_attention.default, cp.mla_attention):
            key = (slots, qsl, seq_lens)
            if key not in causal:  # once per graph: causal key counts pos + 1 (dcp = 1 localisation)
                with graph.inserting_after(max(key, key=_order(graph).__getitem__)):
                    meta = graph.call_function(cp.dcp_localize_metadata.default, (slots, qsl, seq_lens, 1, 0, 1, 1))
                with graph.inserting_after(meta):
                    causal[key] = graph.call_function(operator.getitem, (meta, 2))
            part = graph.call_function(cp.mla_partial_attention.default,
                                       (outs[0], outs[1], cache, block_table, qsl, causal[key], softmax_scale,
                                        *((scale_cache,) if quant else ())))
        else:
            part = graph.call_function(cp.sparse_mla_partial_attention.default,
                                       (outs[0], outs[1], cache, block_table, qsl, attn.args[9], attn.args[10]))
        out = graph.call_function(operator.getitem, (part, 0))
    attn.replace_all_uses_with(out)
    graph.erase_node(attn)
    return True


class MLAPreprocessCacheWritePass(_MLAPOStage):
    """Fold the latent cache write of each `cp::mla_preprocess` into the op."""

    name = "mla_preprocess_cache_write"

    def __call__(self, gm: fx.GraphModule) -> int:
        graph = gm.graph
        count = 0
        causal: dict[tuple[fx.Node, ...], fx.Node] = {}
        for op in [n for n in graph.nodes if is_call(n, *_PREPROCESS)]:
            if op.args[15] is not None:
                continue
            if _fold_local_write(graph, op, _order(graph)) or _fold_attention_write(graph, op, causal):
                count += 1
        if count:
            graph.lint()
            gm.recompile()
        return count
