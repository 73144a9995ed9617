"""DSA-CP pass: token-shard the lightning indexer and sparse MLA over the TP group
in prefill graphs (docs/dsa_cp.md).

Under `CPConfig.enable_dsa_cp` the compiled entry keeps one graph per batch kind
(`CPConfig.graph_per_batch_kind`, `metadata.batch_kind`). This pass runs only in the
"prefill" graph (prefill, chunked-prefill, mixed and speculative batches); the
"decode" graph keeps the TP head layout, where T <= batch size rows would not pay
for the all-to-alls.

In the prefill graph, for every `cp::lightning_indexer` node:

- the indexer becomes `dsa_cp_indexer`: every rank writes all T indexer keys into its
  full index cache and scores only its own `rows = ceil(T / tp)` query rows
  -> top-k rows [rows, K];
- each `cp::sparse_mla_attention` that reads that top-k *directly* (its
  `topk_indices` argument is the indexer node; "paired through the top-k edge")
  becomes `dsa_cp_sparse_attention`: full-cache latent write, all-to-all #1
  (tokens scattered, heads gathered), sparse MLA of the shard's rows with all
  heads, all-to-all #2 back to the TP head layout [T, H/tp, L], so the model's W_UV
  and row-parallel o_proj run unchanged. Several attentions reading one indexer
  (GLM-5's shared-indexer layers) all pair with it;
- every other consumer of the top-k (anything that is not a paired sparse
  attention) gets the step's full top-k [T, K] from one `all_gather_topk` per
  indexer (the indexer-only variant). A `cp::sparse_mla_attention` fed that way
  (through a clone, a view, ...) stays as it is: on this rank's TP heads with the
  single-device top-k it *is* the plain TP model's op, exact, so nothing is refused.
  Every such node is claimed (`fx_utils.CLAIMED_KEY`): the record says who kept it.

All of it is exact for every batch of the prefill graph: each row runs the
single-device reference arithmetic on the global metadata (tests/passes/
test_dsa_cp_model.py checks the whole model against one device).

The compositions read the token count of intermediate tensors (the shard size
ceil(T / tp) and the pad), so unlike the DCP compositions they cannot be traced on
plain proxies: `fx_utils.FakeTracer` gives every node it creates its fake value at
once and its `SizedProxy` answers `.shape` with `aten.sym_size` nodes for symbolic
dims, so the shape arithmetic becomes graph nodes and stays valid for every T.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from cp_compile.passes.context import CompileContext
from cp_compile.ops.parallel import dsa_cp as dsa
from cp_compile.passes.base import CPPass
from cp_compile.passes.fx_utils import CLAIMED_KEY, FakeTracer, bind_op_args, op_nodes

_INDEXER = torch.ops.cp.lightning_indexer
_SPARSE = torch.ops.cp.sparse_mla_attention
# A quantised latent's op (issue 39): the same composition with its scale cache, passed by name.
_SPARSE_QUANT = torch.ops.cp.sparse_mla_attention_quant
_SPARSE_OPS = (_SPARSE, _SPARSE.default, _SPARSE_QUANT, _SPARSE_QUANT.default)


def _sparse_op(node: fx.Node) -> torch._ops.OpOverloadPacket:
    return _SPARSE_QUANT if node.target in (_SPARSE_QUANT, _SPARSE_QUANT.default) else _SPARSE


class DSACPPass(CPPass):
    """Rewrite indexer + sparse MLA into their DSA-CP compositions in prefill graphs."""

    name = "dsa_cp"
    handles = (_INDEXER, _SPARSE, _SPARSE_QUANT)
    enabled_when = ("enable_dsa_cp, a 'prefill' batch-kind graph, tensor_parallel_size > 1, "
                    "decode_context_parallel_size == 1, prefill_context_parallel_size == 1 and an attention "
                    "kind of 'sfa'")

    def __init__(self, ctx: CompileContext) -> None:
        super().__init__(ctx)
        self.shards = ctx.tp_view()

    @classmethod
    def is_enabled(cls, ctx: CompileContext) -> bool:
        spec = ctx.attention
        return (ctx.config.enable_dsa_cp and ctx.prefill_only and ctx.tp.size > 1
                and ctx.dcp.size == 1 and ctx.pcp.size == 1 and spec is not None and spec.kind == "sfa")

    def __call__(self, gm: fx.GraphModule) -> int:
        graph = gm.graph
        indexers = op_nodes(gm, (_INDEXER,))
        if not indexers:
            return 0
        tracer = FakeTracer.for_graph(gm, "the DSA-CP pass")
        wrap = tracer.wrap
        count = 0
        for idx in indexers:
            args = bind_op_args(_INDEXER, idx)
            paired = [u for u in idx.users if u.target in _SPARSE_OPS
                      and bind_op_args(_sparse_op(u), u)["topk_indices"] is idx
                      and sum(a is idx for a in bind_op_args(_sparse_op(u), u).values()) == 1]
            others = [u for u in idx.users if u not in paired]
            with graph.inserting_before(idx):
                rows = dsa.dsa_cp_indexer(**{k: wrap(v) for k, v in args.items()}, ctx=self.shards)  # [rows, K]
                if others:
                    # The indexer-only variant for whatever else reads the top-k: the step's
                    # full [T, K], identical on every rank to the single-device one.
                    full = dsa.all_gather_topk(rows, self.shards, wrap(args["q_i"]).shape[0])  # [T, K]
            for user in others:
                user.replace_input_with(idx, full.node)
            for attn in paired:
                a = bind_op_args(_sparse_op(attn), attn)  # with kv_scale_cache for the quant op
                a.pop("topk_indices")
                with graph.inserting_before(attn):
                    out = dsa.dsa_cp_sparse_attention(**{k: wrap(v) for k, v in a.items()}, topk_rows=rows,
                                                      ctx=self.shards)  # [T, H/tp, L]
                attn.replace_all_uses_with(out.node)
                graph.erase_node(attn)
                count += 1
            graph.erase_node(idx)
            count += 1
        for attn in op_nodes(gm, (_SPARSE, _SPARSE_QUANT)):
            # Not paired: the plain TP op on this rank's heads with a replicated top-k
            # (all-gathered above, or the model's own), exactly what the TP model runs.
            attn.meta[CLAIMED_KEY] = self.name
        tracer.drop_unused_sizes()
        # No dead-code elimination: the cache writes have no users by design.
        graph.lint()
        gm.recompile()
        return count

