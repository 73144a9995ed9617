"""Configuration of tensor / context parallelism and its validation (docs/architecture.md §7).

Rules that depend only on the config are checked when a `CPConfig` is built; rules
that depend on the model (MLA vs GQA, KV head count, indexer) are checked by
`CPConfig.validate_for(spec)`, and the world-size rule by `validate_world_size`.
Every error names the rule, the offending values and the fix.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import torch

from cp_compile.base.errors import ConfigError

AttentionKind = Literal["gqa", "mla", "sfa"]
# The batches one compiled graph serves (docs/architecture.md §11, `metadata.batch_kind`):
# every request at most one new token ("decode"), at most k + 1 under speculation
# ("verify"), or any other batch ("prefill"); None: one graph for all. Under PCP a
# prefill step in which no request has cached context (`metadata.is_fresh`: a prompt
# prefill, a first chunk) runs a graph of its own, "fresh_prefill", whose attention
# has no context part (docs/pcp.md §4); every other config serves it as "prefill".
BatchKind = Literal["decode", "prefill", "verify", "fresh_prefill"]
BATCH_KINDS: tuple[BatchKind, ...] = ("decode", "prefill", "verify", "fresh_prefill")
# Kinds whose graph runs the whole batch on every rank over the sharded cache (no
# token sharding): decode, and speculative verification (k + 1 queries per request).
DECODE_KINDS: tuple[BatchKind, ...] = ("decode", "verify")
# Kinds whose graph serves prefill batches (token-sharded under PCP, query-sharded under DSA-CP).
PREFILL_KINDS: tuple[BatchKind, ...] = ("prefill", "fresh_prefill")
# CPConfig.kv_cache_dtype -> the dtype the quantised pages store (None: the model's dtype).
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {"auto": None, "fp8_e4m3": torch.float8_e4m3fn,
                                                  "int8": torch.int8}


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class AttentionSpec:
    """What the config rules need to know about a model's attention.

    kind: "gqa" (paged GQA/MHA), "mla" (absorbed MLA) or "sfa" (MLA + lightning
    indexer, sparse top-k attention).
    """

    kind: AttentionKind
    num_heads: int
    num_kv_heads: int = 1
    has_indexer: bool = False

    def __post_init__(self) -> None:
        if self.kind not in ("gqa", "mla", "sfa"):
            raise ConfigError("attention kind is gqa|mla|sfa", f"kind={self.kind!r}",
                              "describe the model's attention as 'gqa', 'mla' or 'sfa'")
        for name in ("num_heads", "num_kv_heads"):
            v = getattr(self, name)
            if not _is_int(v) or v < 1:
                raise ConfigError(f"{name} >= 1", f"{name}={v!r} ({type(v).__name__})",
                                  f"describe the model's {name.replace('_', ' ')} as a positive integer")
        if not isinstance(self.has_indexer, bool):
            raise ConfigError("AttentionSpec.has_indexer is a bool", f"has_indexer={self.has_indexer!r}",
                              "set has_indexer to True or False")
        if self.kind == "sfa" and not self.has_indexer:
            raise ConfigError("sfa models have an indexer", "kind='sfa', has_indexer=False",
                              "set has_indexer=True or use kind='mla'")


@dataclass(frozen=True)
class CPConfig:
    """Parallel layout of one serving instance.

    world_size = tensor_parallel_size * prefill_context_parallel_size; DCP groups are
    consecutive ranks inside each TP group and do not add devices.
    """

    tensor_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    prefill_context_parallel_size: int = 1
    cp_kv_cache_interleave_size: int = 1
    block_size: int = 128
    enable_dsa_cp: bool = False
    # How decode partial outputs are merged: "ag_rs" (all-gather LSE, rescale,
    # reduce-scatter), "a2a" (one all-to-all of [out | lse] + local combine), or
    # "replicate" (query replication, Helix-style: every rank of the group computes the
    # query heads of all its ranks, so the query all-gather goes and one all-to-all of
    # [out | lse] is the layer's only collective; decode graphs' DCP attention, the
    # query projection's parameters gathered once at compile time, decision 49), or
    # "auto": per compiled graph, the one the cost model predicts cheapest from the bytes
    # each moves, the group's collective costs and the replicated query projection's
    # cost, measured at init_parallel (cp_compile/base/merge_cost.py, issue 26).
    dcp_merge: Literal["auto", "ag_rs", "a2a", "replicate"] = "auto"
    # Project before the merge (issue 37, decision 61): where a per-head linear map with
    # parameter weights follows the attention (MLA's W_UV, latent -> V head dim), apply it
    # to every rank's partial before the merge, so the merge moves the V head dim (MLA: 128
    # instead of 512 columns per head) at the price of projecting the group's heads (the
    # other ranks' weights gathered at compile time). "auto": the cost model decides with
    # the merge (it runs under dcp_merge="auto"; with an explicit merge and no measured
    # costs, off); "on": wherever provable (a ConfigError where an MLA / SFA attention's
    # output is not provably followed by one); "off": never. GQA has nothing to project.
    dcp_project_before_merge: Literal["auto", "on", "off"] = "auto"
    # The all-reduce fold (issue 37, decision 62): where the attention's output reaches a
    # row-parallel o_proj (no bias before its TP all-reduce, nothing between o_proj and the
    # all-reduce), gather only the LSEs over the DCP group, rescale this rank's partial of the
    # group's N*H heads, multiply it by the o_proj columns of those heads (gathered at compile
    # time: (N - 1) x this rank's o_proj shard more weight memory per layer) and let the TP
    # all-reduce sum heads and shards in one collective: the output merge's reduce-scatter /
    # all-to-all goes. "auto": the cost model decides with the merge (under dcp_merge="auto",
    # costs measured) and never where the gathered o_proj columns exceed
    # `merge_cost.FOLD_KV_FRACTION` of the graph's KV cache bytes; "on": wherever provable
    # (a ConfigError naming the reason elsewhere); "off" (default): never.
    dcp_merge_fold: Literal["auto", "on", "off"] = "off"
    # MLAPO: the `mla_preprocess` pass fuses each MLA layer's pre-attention subgraph
    # (projections, norms, rope, W_UK absorption, latent cache write) into
    # cp::mla_preprocess. Off by default: exact everywhere, but faster only where the
    # fused kernel beats what the lowering already fuses (docs/mla_preprocess.md).
    enable_mla_preprocess: bool = False
    # What the paged K/V (GQA) or latent (MLA) cache stores: "auto" (the dtype the cache is
    # allocated with, the model's, as before issue 39), "fp8_e4m3" (float8_e4m3fn) or
    # "int8", each token's row quantised when written with a dynamic fp32 scale per token
    # and KV head kept beside the pages ([num_blocks, block_size, kv_heads], the same
    # sharded layout: a token's scale lives on its owner rank; decision 65).
    kv_cache_dtype: Literal["auto", "fp8_e4m3", "int8"] = "auto"

    @property
    def kv_cache_quantized(self) -> bool:
        return self.kv_cache_dtype != "auto"

    @property
    def graph_per_batch_kind(self) -> bool:
        """True when decode and prefill batches need different graphs: PCP token-shards
        only prefill, DSA-CP keeps decode in the TP head layout. The compiled entry
        then keeps one graph per `metadata.batch_kind` and picks one per step."""
        return self.prefill_context_parallel_size > 1 or self.enable_dsa_cp

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "decode_context_parallel_size",
                     "prefill_context_parallel_size", "block_size"):
            v = getattr(self, name)
            # bool is an int subclass: True would pass as 1 and hide a wrong argument.
            if not _is_int(v) or v < 1:
                raise ConfigError(f"{name} >= 1", f"{name}={v!r} ({type(v).__name__})",
                                  f"set {name} to a positive integer (int, not bool or float)")
        for name in ("enable_dsa_cp", "enable_mla_preprocess"):
            v = getattr(self, name)
            if not isinstance(v, bool):
                raise ConfigError(f"{name} is a bool", f"{name}={v!r} ({type(v).__name__})",
                                  f"set {name} to True or False")
        i = self.cp_kv_cache_interleave_size
        if not _is_int(i) or i < 1:
            raise ConfigError("cp_kv_cache_interleave_size >= 1",
                              f"cp_kv_cache_interleave_size={i!r} ({type(i).__name__})",
                              "use 1 (token interleave) or a divisor of block_size")
        if self.block_size % i != 0:
            raise ConfigError("block_size % cp_kv_cache_interleave_size == 0",
                              f"block_size={self.block_size}, cp_kv_cache_interleave_size={i}",
                              f"choose an interleave that divides {self.block_size}, e.g. 1 or {self.block_size}")
        if self.enable_dsa_cp and (self.decode_context_parallel_size > 1 or self.prefill_context_parallel_size > 1):
            # DSA-CP shards the queries over TP on full caches (dcp = 1); with DCP the latent
            # cache is sharded and the rows would need a partial (LSE) row op, a top-k remap
            # and a token-order merge (docs/dsa_cp.md, "What is left"). Not built.
            raise ConfigError("enable_dsa_cp needs decode_context_parallel_size == 1 and "
                              "prefill_context_parallel_size == 1 (DSA-CP with DCP / PCP is not built)",
                              f"enable_dsa_cp=True, decode_context_parallel_size={self.decode_context_parallel_size}, "
                              f"prefill_context_parallel_size={self.prefill_context_parallel_size}",
                              "set enable_dsa_cp=False to shard the cache with DCP, or "
                              "decode_context_parallel_size=1 and prefill_context_parallel_size=1 to use DSA-CP")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError("kv_cache_dtype is auto|fp8_e4m3|int8", f"kv_cache_dtype={self.kv_cache_dtype!r}",
                              "use 'auto' (the model's dtype), 'fp8_e4m3' or 'int8' (quantised pages with a scale "
                              "per token and KV head)")
        if self.dcp_merge not in ("auto", "ag_rs", "a2a", "replicate"):
            raise ConfigError("dcp_merge is auto|ag_rs|a2a|replicate", f"dcp_merge={self.dcp_merge!r}",
                              "use 'auto' (the cost model chooses), 'ag_rs', 'a2a' or 'replicate'")
        if self.dcp_project_before_merge not in ("auto", "on", "off"):
            raise ConfigError("dcp_project_before_merge is auto|on|off",
                              f"dcp_project_before_merge={self.dcp_project_before_merge!r}",
                              "use 'auto' (the cost model decides with the merge), 'on' or 'off'")
        if self.dcp_merge_fold not in ("auto", "on", "off"):
            raise ConfigError("dcp_merge_fold is auto|on|off", f"dcp_merge_fold={self.dcp_merge_fold!r}",
                              "use 'off' (default), 'on' (fold wherever provable) or 'auto' (the cost model decides)")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.prefill_context_parallel_size

    @property
    def context_parallel_size(self) -> int:
        """Ranks one request's KV cache is sharded over: pcp * dcp (docs/pcp.md).
        Under PCP the cache is laid out by the §5 rule at N = pcp * dcp, context-parallel
        rank = pcp_rank * dcp + dcp_rank, so a decode on the same ranks reads it as is."""
        return self.prefill_context_parallel_size * self.decode_context_parallel_size

    @property
    def virtual_block_size(self) -> int:
        """Tokens per block as the runtime (and a single device) sees it: each of the
        pcp * dcp ranks the cache is sharded over holds block_size of them."""
        return self.block_size * self.context_parallel_size

    def replace(self, **changes) -> "CPConfig":
        return dataclasses.replace(self, **changes)

    def validate_for(self, spec: AttentionSpec) -> None:
        """Check every rule of docs/architecture.md §7 that needs no launched world, for `spec`.

        Only the world size (`validate_world_size`) is left to `init_parallel`.
        """
        if not isinstance(spec, AttentionSpec):
            raise ConfigError("validate_for takes an AttentionSpec", f"got {type(spec).__name__}",
                              "pass model.attention_spec() (a cp_compile.AttentionSpec)")
        tp, dcp, pcp = self.tensor_parallel_size, self.decode_context_parallel_size, self.prefill_context_parallel_size
        if spec.kind in ("mla", "sfa"):
            if tp < dcp or tp % dcp != 0:
                raise ConfigError("tp >= dcp and tp % dcp == 0 (MLA/SFA)",
                                  f"tensor_parallel_size={tp}, decode_context_parallel_size={dcp}",
                                  "choose a decode_context_parallel_size that divides tensor_parallel_size")
        else:
            kv = spec.num_kv_heads
            if kv < 1:
                raise ConfigError("num_kv_heads >= 1", f"num_kv_heads={kv}", "describe the model's KV heads")
            rep = tp // kv
            # A DCP constraint: without DCP (dcp == 1) plain TP may hold several KV heads per rank.
            if dcp > 1 and (rep < dcp or rep % dcp != 0):
                raise ConfigError("tp // num_kv_heads >= dcp and (tp // num_kv_heads) % dcp == 0 (GQA)",
                                  f"tensor_parallel_size={tp}, num_kv_heads={kv} (tp // kv = {rep}), "
                                  f"decode_context_parallel_size={dcp}",
                                  "DCP ranks must share KV heads: raise tp or lower dcp so that dcp divides tp // num_kv_heads")
            # DCP groups are consecutive runs of dcp ranks inside a TP group: they must
            # tile it. init_parallel's rule, which the per-head rule misses for e.g.
            # tp = 5, kv = 2, dcp = 2 (tp // kv = 2).
            if tp % dcp != 0:
                raise ConfigError("tp % dcp == 0", f"tensor_parallel_size={tp}, decode_context_parallel_size={dcp}",
                                  "choose a decode_context_parallel_size that divides tensor_parallel_size")
            if dcp > 1 and tp % kv != 0:
                # Each KV head must sit on the same number of consecutive ranks, or a DCP
                # group straddles two heads (tp = 10, kv = 4: ranks 8, 9 hold no head).
                raise ConfigError("tp % num_kv_heads == 0 (GQA with DCP)",
                                  f"tensor_parallel_size={tp}, num_kv_heads={kv}, decode_context_parallel_size={dcp}",
                                  "choose tp as a multiple of num_kv_heads so every KV head is replicated "
                                  "on tp // num_kv_heads ranks")
        if spec.kind == "sfa" and pcp > 1:
            # PCP compositions exist for dense GQA and MLA only (ops/parallel/pcp.py);
            # a sparse MLA layer under PCP would meet no pass and be refused at compile.
            raise ConfigError("prefill_context_parallel_size == 1 for SFA (PCP covers GQA and MLA)",
                              f"attention kind='sfa', prefill_context_parallel_size={pcp}, "
                              f"tensor_parallel_size={tp}, decode_context_parallel_size={dcp}",
                              "set prefill_context_parallel_size=1 (SFA shards its cache with DCP: "
                              f"decode_context_parallel_size={tp})")
        if spec.kind == "sfa" and pcp == 1 and dcp > 1 and dcp != tp:
            raise ConfigError("dcp == tp for SFA DCP with replicated indexer",
                              f"tensor_parallel_size={tp}, decode_context_parallel_size={dcp}",
                              f"set decode_context_parallel_size={tp}")
        if self.enable_dsa_cp and not spec.has_indexer:
            raise ConfigError("enable_dsa_cp only for models with an indexer",
                              f"enable_dsa_cp=True, attention kind={spec.kind!r} without indexer",
                              "set enable_dsa_cp=False for models without a lightning indexer")

    def validate_world_size(self, world_size: int) -> None:
        if world_size != self.world_size:
            raise ConfigError("world size == tp * pcp",
                              f"world_size={world_size}, tensor_parallel_size={self.tensor_parallel_size}, "
                              f"prefill_context_parallel_size={self.prefill_context_parallel_size} "
                              f"(tp * pcp = {self.world_size})",
                              f"launch {self.world_size} ranks or change tp / pcp so that tp * pcp == {world_size}")
