"""The model graphs: the example models (GQA, MLA; the sparse SFA model) rewritten for
DCP and compiled through the public path (`cp_compile.compile_model(...,
lowering="torchair")` after `init_parallel`) on gloo ranks, so the DCP and TP group
names in the GE graph are real; and what each model's GE graph must hold."""

from __future__ import annotations

import os
import re
from dataclasses import asdict
from typing import Any

import torch

from tools import torchair_standin as standin
from tools.ge_check.converters import CONVERTERS_ENV, folder_sources, load_converters
from tools.ge_check.reading import FxRecorder, GraphResult, compile_and_load

MODEL_CONFIGS = [("gqa", 1, "ag_rs"), ("gqa", 2, "ag_rs"), ("gqa", 2, "a2a"),
                 ("mla", 1, "ag_rs"), ("mla", 2, "ag_rs"), ("mla", 2, "a2a"),
                 # A quantised KV cache (issue 39, decision 70): MERGE/KV_CACHE_DTYPE. The DCP
                 # pass's quant compositions: cp::quant_cache_write (codes + scales) and the
                 # partials with their scale caches (FIA antiquant mode 5).
                 ("gqa", 2, "ag_rs/int8")]
# Run by hand, not in the default check (each quantised model world costs ~35 s of the
# suite's one GE run; MLA's int8 read and write are in the default op graphs,
# `cp::mla_partial_attention[int8]` and `cp::mla_attention_quant`):
#   .venv-torchair/bin/python -m tools.ge_check --model mla:2:a2a/int8
BY_HAND_CONFIGS = [("mla", 2, "a2a/int8")]
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
# Seed of the model graphs' token ids and page order: the same on every rank (the ranks
# of a TP / DCP group must see one batch), so a failure reproduces.
INPUT_SEED = 35


def token_ids(count: int, vocab: int, generator: torch.Generator) -> torch.Tensor:
    """[count] int64 distinct token ids: all-zero ids embed every token alike, which
    hides a converter that mixes tokens up (issue 35 item 8)."""
    return torch.randperm(vocab, generator=generator)[:count]


def shuffle_free_pages(allocator: Any, generator: torch.Generator) -> None:
    """Make `allocator` (a fresh runtime BlockAllocator) hand out its pages in a seeded
    random order instead of 0, 1, 2, ...: its pop() order is its free list's, so the
    block tables it builds are distinct per request (it never hands out a live page)
    and not the identity, which a converter gathering the wrong table row or column
    would still read right; the metadata's slots come from the same tables."""
    free = list(allocator._free)
    allocator._free = [free[i] for i in torch.randperm(len(free), generator=generator).tolist()]


def _model(kind: str, tp: int, tp_rank: int, tp_group: Any, w8a8: bool = False) -> torch.nn.Module:
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


def _rank_main(rank: int, world: int, configs: list[tuple[str, int, str]], dump: str | None) -> list[dict]:
    standin.install()
    import cp_compile
    from cp_compile.runtime.metadata_build import BlockAllocator
    from tools.ge_eval import hccl, probe

    folder = os.environ.get(CONVERTERS_ENV)
    if folder:  # a spawned rank imports the converters anew: the copies the check runs with
        load_converters(folder_sources(folder))
    probe.install(hccl.Comm())

    recorder = FxRecorder()
    if dump:
        os.environ["CP_COMPILE_GE_DUMP"] = os.path.join(dump, f"rank{rank}")
    out = []
    for kind, dcp, merge in configs:
        torch._dynamo.reset()
        dsa = merge == "dsa_cp"
        merge, _, kv_dtype = merge.partition("/")
        cfg = cp_compile.CPConfig(tensor_parallel_size=world, decode_context_parallel_size=dcp, block_size=4,
                                  kv_cache_dtype=kv_dtype or "auto",
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
            gen = torch.Generator().manual_seed(INPUT_SEED)
            alloc = BlockAllocator(16, cfg.virtual_block_size)
            shuffle_free_pages(alloc, gen)
            meta = cp_compile.build_attention_metadata([(0, 5), (0, 3)], alloc, num_padding_tokens=2,
                                                       max_blocks_per_req=4)
            ids = token_ids(10, 128, gen)  # the example models' vocab_size (_model)
            name = f"{kind} tp={world} dcp={dcp}" + (f" {merge}" if dcp > 1 or dsa else "") + \
                (f" {kv_dtype}" if kv_dtype else "")

            def step() -> None:
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
                            compiled(token_ids(7, 128, gen), second.positions, layers, second)

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


def run_model_graphs(dump: str | None, configs: list[tuple[str, int, str]] | None = None) -> list[GraphResult]:
    from cp_compile.testing.multirank import run_on_ranks

    configs = configs or MODEL_CONFIGS + SFA_CONFIGS
    dense = [c for c in configs if c[0] != "sfa"]
    sfa = [c for c in configs if c[0] == "sfa"]
    per_rank = run_on_ranks(_rank_main, MODEL_WORLD, dense, dump, timeout=600) if dense else []
    per_rank += run_on_ranks(_rank_main, SFA_WORLD, sfa, dump, timeout=600) if sfa else []
    return [GraphResult(**r) for rank in per_rank for r in rank]


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
    quant = r.name.endswith(" int8")  # codes and scales scattered, FIA's page-managed antiquant scales
    mode = (5 if kind == "gqa" else 4) if quant else 0
    for a in fia:
        if (a.get("key_antiquant_mode"), a.get("value_antiquant_mode")) != (mode, mode):
            problems.append(f"FusedInferAttentionScore antiquant modes {a}, want {mode}")
    writes = layers * (2 if kind == "gqa" else 1) * (2 if quant else 1)  # k and v / the latent (+ their scales)
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
        want = {"ScatterNdUpdate": writes}
    else:
        merge = r.name.split()[3]
        q_gathers = 1  # GQA gathers q; MLA one fused [q_nope | q_pe]
        want = {"ScatterNdUpdate": writes}
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

