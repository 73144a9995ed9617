"""PCP at model level on real gloo ranks: the compiled example models == one device.

HF tiny Qwen3 (GQA) and DeepSeek-V3 (MLA) weights through the example models,
compiled with `cp_compile.compile_model` at prefill_context_parallel_size = 2. The
schedule (`STEPS`) has prefill steps (odd lengths, a request shorter than 2 * pcp, a
1-token request beside them, batch padding), a chunked prefill on a cached prefix,
decode steps on the same cache, and a request that joins late (a mixed batch).
Prefill steps run the token-sharded prefill graph (`pcp_attention` pass), decode
steps the decode graph (`dcp_attention` over the pcp * dcp ranks of the cache).

Checked on every rank: every step's last-token logits (1e-4) and greedy tokens equal
the single-device eager model's; the decode graph reads the cache tensors the PCP
prefill wrote (same tensors, data pointers unchanged) and this rank's cache shard
holds exactly the tokens the single-device cache holds at the slots the layout gives
this cp rank (so nothing was copied or re-laid out between prefill and decode); each
kind compiled its own graph with the expected passes.
"""

from __future__ import annotations

import time

import pytest
import torch

import cp_compile
from cp_compile.runtime.kv_cache import tp_kv_head_ids
from cp_compile.testing.multirank import run_on_ranks
from examples.models.tiny import VOCAB, example_from_config, hf_deepseek_v3, hf_qwen3

BLOCK = 4
NUM_BLOCKS = 12
PAD = 2  # padding tokens per step (a graph-mode runtime pads to a captured size)

# Prompts (token ids drawn per request id); each step lists (request id, new tokens):
# None = all not-yet-run tokens of the prompt, or 1 generated token once the prompt is done.
PROMPT_LENS = {0: 9, 1: 3, 2: 12, 3: 1, 4: 5}
STEPS: list[list[tuple[int, int | None]]] = [
    [(0, None), (1, None), (2, 5), (3, None)],  # prefill: 9 (odd), 3 (< 2*pcp), 5 of 12, 1
    [(0, None), (1, None), (2, None), (3, None)],  # chunked prefill: 7 more of request 2 on its 5 cached
    [(0, None), (1, None), (2, None), (3, None)],  # decode
    [(0, None), (2, None), (4, None)],  # request 4 joins (5 tokens) beside decodes; 1 and 3 left
    [(0, None), (2, None), (4, None)],  # decode
]


def _prompts() -> dict[int, list[int]]:
    g = torch.Generator().manual_seed(0)
    return {r: torch.randint(0, VOCAB, (n,), generator=g).tolist() for r, n in PROMPT_LENS.items()}


def run_steps(forward, kv_layers, cfg: cp_compile.CPConfig, steps: list | None = None) -> list[dict]:
    """Greedy steps of `steps` (default `STEPS`) through forward(input_ids, positions, kv_layers, meta);
    `graph`: the compiled graph each step ran (CompiledForward.batch_kind_of; None for an eager model)."""
    alloc = cp_compile.BlockAllocator(NUM_BLOCKS, cfg.virtual_block_size)
    tokens = _prompts()
    done: dict[int, int] = {r: 0 for r in tokens}  # tokens of each request already in the cache
    out = []
    for step in STEPS if steps is None else steps:
        rids, reqs, ids = [], [], []
        for rid, n in step:
            prompt_left = PROMPT_LENS[rid] - done[rid]
            new = n if n is not None else max(prompt_left, 1)
            assert done[rid] + new <= len(tokens[rid])
            rids.append(rid)
            reqs.append((done[rid], new))
            ids += tokens[rid][done[rid]:done[rid] + new]
        meta = cp_compile.build_attention_metadata(reqs, alloc, req_ids=rids, num_padding_tokens=PAD,
                                                   max_blocks_per_req=8)
        with torch.no_grad():
            logits = forward(torch.tensor(ids + [0] * PAD), meta.positions, kv_layers, meta)  # [T, vocab]
        assert logits.shape[0] == meta.num_tokens
        last = logits[meta.query_start_loc[1:].long() - 1]  # [B, vocab]
        nxt = last.argmax(-1).tolist()
        for (rid, _), (ctx, new), t in zip(step, reqs, nxt):
            done[rid] = ctx + new
            if done[rid] >= PROMPT_LENS[rid] and done[rid] == len(tokens[rid]):
                tokens[rid].append(t)  # sample only once the whole prompt is in
        graph = forward.batch_kind_of({"meta": meta}) if hasattr(forward, "batch_kind_of") else None
        out.append(dict(rids=rids, kind=cp_compile.runtime.metadata.batch_kind(meta), graph=graph, last=last.clone(),
                        next=nxt))
    return out


def _hf(kind: str, num_kv_heads: int = 1):
    if kind == "qwen3":
        return hf_qwen3(num_kv_heads=num_kv_heads, num_heads=4)
    return hf_deepseek_v3(q_lora_rank=None, num_heads=4)


def _world(rank: int, world: int, cases: list[tuple]) -> list[dict]:
    """Each case (tp, dcp, pcp, interleave, lowering, hf_config, state_dict) in turn on
    this rank (one spawned world serves several cases: spawning ranks is slow)."""
    outs = []
    for tp, dcp, pcp, interleave, lowering, hf_config, state_dict, kv_cache_dtype, *cfg_kw in cases:
        cfg = cp_compile.CPConfig(tensor_parallel_size=tp, decode_context_parallel_size=dcp,
                                  prefill_context_parallel_size=pcp, cp_kv_cache_interleave_size=interleave,
                                  block_size=BLOCK, kv_cache_dtype=kv_cache_dtype, **(cfg_kw or [{}])[0])
        state = cp_compile.init_parallel(cfg, device="cpu")
        model = example_from_config(hf_config, state_dict, tp, state.layout.tp.rank, state.tp_group)
        cache = cp_compile.allocate_kv_cache(cfg, model.kv_cache_spec(), NUM_BLOCKS,
                                             attention=model.attention_spec())
        compiled = cp_compile.compile_model(model, lowering=lowering)
        ptrs = [t.data_ptr() for layer in cache.layers for t in layer]
        # A runtime that forgets PCP in its block size (blocks of BLOCK * dcp) is refused on every rank
        # before anything is written: blocks hold BLOCK * pcp * dcp tokens.
        bad = cp_compile.BlockAllocator(NUM_BLOCKS, BLOCK * dcp)
        bad.ensure(99, 1)  # block 0 taken: the request's block ids then differ from its positions' blocks
        meta = cp_compile.build_attention_metadata([(0, 9)], bad)
        with pytest.raises(cp_compile.runtime.metadata.MetadataError, match=rf"block of {BLOCK * pcp * dcp} tokens"):
            compiled(torch.zeros(9, dtype=torch.long), meta.positions, cache.layers, meta)
        assert all(int(t.view(torch.uint8).count_nonzero()) == 0 for layer in cache.layers for t in layer)
        t0 = time.perf_counter()
        res = run_steps(compiled, cache.layers, cfg)
        wall = time.perf_counter() - t0
        assert [t.data_ptr() for layer in cache.layers for t in layer] == ptrs  # no cache was replaced
        # The fresh step (step 0) again, on a fresh cache, through the general prefill graph (compiled by
        # step 1): its logits against the fresh graph's (issue 26).
        compiled.fresh_prefill_graph = False
        again = cp_compile.allocate_kv_cache(cfg, model.kv_cache_spec(), NUM_BLOCKS, attention=model.attention_spec())
        general = run_steps(compiled, again.layers, cfg, STEPS[:1])[0]
        compiled.fresh_prefill_graph = True
        hist = {kind: [[(h.name, h.rewrites, h.before, h.after) for h in pm.history] for pm in b.pass_managers]
                for kind, b in compiled.backends.items()}
        kinds = {kind: [c.batch_kind for c in b.contexts] for kind, b in compiled.backends.items()}
        outs.append(dict(results=res, general=general,
                         cache=[tuple(t.clone() for t in layer) for layer in cache.layers],
                         cp_rank=state.layout.cp.rank, hist=hist, kinds=kinds, wall=wall, tp_rank=state.layout.tp.rank))
        cp_compile.destroy_parallel()
        torch._dynamo.reset()  # the next case compiles the same forward code afresh
    return outs


def _reference(hf_config, state_dict, n: int, kv_cache_dtype: str = "auto"):
    model = example_from_config(hf_config, state_dict)
    # one device: pages of a whole virtual block; the same (quantised) cache dtype
    cfg = cp_compile.CPConfig(block_size=BLOCK * n, kv_cache_dtype=kv_cache_dtype)
    cache = cp_compile.allocate_kv_cache(cfg, model.kv_cache_spec(), NUM_BLOCKS)
    return run_steps(model, cache.layers, cfg), cache.layers


def _shard_of(full: torch.Tensor, n: int, cp_rank: int, interleave: int) -> torch.Tensor:
    """The single-device cache [NB, BLOCK*n, ...] as cp rank `cp_rank` stores it
    ([NB, BLOCK, ...]): offset j of a virtual block is owned by (j // I) % n and lands
    at local offset (j // (n*I)) * I + j % I (docs/architecture.md §5 at N = n)."""
    j = torch.arange(BLOCK * n)
    owner = (j // interleave) % n
    local = (j // (n * interleave)) * interleave + j % interleave
    if full.dtype == torch.float8_e4m3fn:  # fp8 pages: moved as bytes (no fp8 index_put on CPU)
        return _shard_of(full.view(torch.uint8), n, cp_rank, interleave).view(full.dtype)
    shard = torch.zeros(full.shape[0], BLOCK, *full.shape[2:], dtype=full.dtype)
    mine = owner == cp_rank
    shard[:, local[mine]] = full[:, j[mine]]
    return shard


def _count(hist: dict[str, int], needle: str) -> int:
    return sum(v for k, v in hist.items() if needle in k)


def _case(kind: str, tp: int, dcp: int, pcp: int, lowering: str, interleave: int = 1, num_kv_heads: int = 1,
          kv_cache_dtype: str = "auto", cfg_kw: dict | None = None):
    return dict(kind=kind, tp=tp, dcp=dcp, pcp=pcp, lowering=lowering, interleave=interleave,
                num_kv_heads=num_kv_heads, kv_cache_dtype=kv_cache_dtype, cfg_kw=cfg_kw or {})


def check_pcp_models(cases: list[dict]) -> dict[str, float]:
    """Run `cases` (same world size) in one spawned world; check each against one device.
    Returns the largest last-token logit difference per case."""
    world = cases[0]["tp"] * cases[0]["pcp"]
    assert all(c["tp"] * c["pcp"] == world for c in cases)
    hfs = [_hf(c["kind"], c["num_kv_heads"]) for c in cases]
    sds = [{k: v.detach().clone() for k, v in hf.state_dict().items()} for hf in hfs]
    per_rank = run_on_ranks(_world, world, [(c["tp"], c["dcp"], c["pcp"], c["interleave"], c["lowering"],
                                             hf.config, sd, c["kv_cache_dtype"], c.get("cfg_kw", {}))
                                            for c, hf, sd in zip(cases, hfs, sds)],
                            timeout=900)
    return {_name(c): _check_case(c, hf, sd, [outs[i] for outs in per_rank])
            for i, (c, hf, sd) in enumerate(zip(cases, hfs, sds))}


def _name(c: dict) -> str:
    return (f"{c['kind']} tp={c['tp']} dcp={c['dcp']} pcp={c['pcp']} interleave={c['interleave']} "
            f"kv_heads={c['num_kv_heads']} {c['lowering']}"
            + (f" kv={c['kv_cache_dtype']}" if c["kv_cache_dtype"] != "auto" else ""))


def _check_case(c: dict, hf, sd, per_rank: list[dict]) -> float:
    kind, tp, dcp, pcp, interleave, num_kv_heads = (c["kind"], c["tp"], c["dcp"], c["pcp"], c["interleave"],
                                                    c["num_kv_heads"])
    n = pcp * dcp
    ref, ref_cache = _reference(hf.config, sd, n, c["kv_cache_dtype"])
    layers = hf.config.num_hidden_layers
    attn_op = "cp.gqa_paged_attention" if kind == "qwen3" else "cp.mla_attention"
    worst = 0.0
    per_step = [0.0] * len(STEPS)
    fresh_vs_general = 0.0
    for rank, out in enumerate(per_rank):
        assert [s["kind"] for s in out["results"]] == ["prefill", "prefill", "decode", "prefill", "decode"]
        # Step 0 has no cached context: the fresh graph; the chunked step and the mixed batch (request 4
        # joins beside requests with context) the general one.
        assert [s["graph"] for s in out["results"]] == ["fresh_prefill", "prefill", "decode", "prefill", "decode"]
        assert out["general"]["graph"] == "prefill"
        torch.testing.assert_close(out["results"][0]["last"], out["general"]["last"], atol=1e-4, rtol=1e-4,
                                   msg=f"{kind} rank {rank} step 0: fresh graph vs general prefill graph")
        diff = (out["results"][0]["last"] - out["general"]["last"]).abs().max().item()
        fresh_vs_general = max(fresh_vs_general, diff)
        for step, (got, want) in enumerate(zip(out["results"], ref)):
            assert got["rids"] == want["rids"]
            torch.testing.assert_close(got["last"], want["last"], atol=1e-4, rtol=1e-4,
                                       msg=f"{kind} rank {rank} step {step}")
            assert got["next"] == want["next"], f"{kind} rank {rank} step {step}"
            diff = (got["last"] - want["last"]).abs().max().item()
            per_step[step] = max(per_step[step], diff)
            worst = max(worst, diff)
        # The cache the PCP prefill and the decode steps wrote is the single-device cache, sharded by the
        # §5 rule over the pcp * dcp ranks (this rank's TP KV heads).
        for layer, (mine, full) in enumerate(zip(out["cache"], ref_cache)):
            for t_mine, t_full in zip(mine, full):
                if kind == "qwen3":  # this TP rank's KV heads
                    t_full = t_full[:, :, list(tp_kv_head_ids(num_kv_heads, tp, out["tp_rank"]))]
                want_shard = _shard_of(t_full, n, out["cp_rank"], interleave)
                if t_mine.dtype in (torch.int8, torch.float8_e4m3fn):  # quantised codes: the owner's bytes
                    assert torch.equal(t_mine.view(torch.uint8), want_shard.view(torch.uint8)), \
                        f"{kind} rank {rank} layer {layer} codes"
                    continue
                torch.testing.assert_close(t_mine, want_shard, atol=1e-5, rtol=1e-5,
                                           msg=f"{kind} rank {rank} layer {layer} cache shard")
        # One graph per batch kind, compiled once (dynamic token dims: no recompile as T_loc changes);
        # prefill: pcp_attention rewrote every layer and restored the logits.
        assert out["kinds"] == {"decode": ["decode"], "prefill": ["prefill"],
                                "fresh_prefill": ["fresh_prefill"]}, out["kinds"]
        for graph in out["hist"]["prefill"] + out["hist"]["fresh_prefill"]:
            names = [h[0] for h in graph]
            assert names[0] == "pcp_attention" and "dcp_attention" not in names, names
            _, rewrites, before, after = graph[0]
            assert rewrites == layers + 1  # every attention layer + the logits output
            assert _count(before, attn_op) == layers and _count(after, attn_op) == 0
            assert _count(after, "cp.dcp_localize_metadata") == 1  # one pcp_step per graph
        # Collectives the pass adds: per forward the token-index and the logits' all-gathers; per layer the
        # general graph the new K/V (latent), Q and LSE all-gathers and the context merge's reduce-scatter
        # (more with DCP), the fresh graph the new K/V (latent) all-gather only (issue 26).
        for which, per_layer_ag, per_layer_rs in (("prefill", 3, 1), ("fresh_prefill", 1, 0)):
            for graph in out["hist"][which]:
                _, _, before, after = graph[0]
                added = {op: _count(after, op) - _count(before, op)
                         for op in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all")}
                if which == "fresh_prefill" or dcp == 1:
                    assert added == {"all_gather_into_tensor": 2 + per_layer_ag * layers,
                                     "reduce_scatter_tensor": per_layer_rs * layers, "all_to_all": 0}, (which, added)
                if which == "fresh_prefill":
                    assert _count(after, "cp.lse_combine") == 0 == _count(after, "cp.lse_rescale")
        for graph in out["hist"]["decode"]:
            names = [h[0] for h in graph]
            assert names[0] == "dcp_attention" and "pcp_attention" not in names, names
            assert graph[0][1] == layers
            if c.get("cfg_kw", {}).get("dcp_project_before_merge") == "on":  # W_UV moved before every merge
                assert dict((h[0], h[1]) for h in graph).get("project_before_merge") == layers, names
    steps = " / ".join(f"{d:.1e}" for d in per_step)
    print(f"\nPCP {_name(c)}: max |logit diff| {worst:.2e} (per step: prefill / chunked / decode / "
          f"join+decode / decode = {steps}), fresh vs general prefill graph at step 0 {fresh_vs_general:.1e}, "
          f"tokens equal; rank 0 steps (compiles included) "
          f"{per_rank[0]['wall']:.1f} s")
    return worst


def test_pcp2_models_match_single_device():
    """pcp = 2, tp = 1: Qwen3 (GQA) through Inductor, DeepSeek-V3 (MLA) eager, one world;
    Qwen3 with 2 KV heads per rank eager (4: tests/ops/test_dcp_kv_heads.py and the fuzz) (the decode graph gathers the query heads of
    ranks that hold the same KV heads: before issue 19's fix its first decode was 6.8 off)."""
    check_pcp_models([_case("qwen3", 1, 1, 2, "inductor"), _case("mla", 1, 1, 2, "eager"),
                      _case("qwen3", 1, 1, 2, "eager", num_kv_heads=2)])


def test_pcp2_quantised_models_match_single_device():
    """A quantised KV cache (issue 39, decision 68): pcp = 2, tp = 1, Qwen3 (GQA) int8, eager:
    the PCP pass rewrites the quant ops, the logits and tokens equal one device with the same
    quantised cache, and the cache each rank holds is the single device's, codes byte-equal
    and scales, sharded by the §5 rule (MLA fp8 and tp 2: `slow`; both kinds per composition:
    tests/cp_compile/test_pcp_exactness.py)."""
    check_pcp_models([_case("qwen3", 1, 1, 2, "eager", kv_cache_dtype="int8")])


@pytest.mark.slow
def test_pcp2_quantised_mla_model_matches_single_device():
    check_pcp_models([_case("mla", 1, 1, 2, "eager", kv_cache_dtype="fp8_e4m3")])


@pytest.mark.slow
def test_pcp2_tp2_quantised_models_match_single_device():
    """tp 2, dcp 2, pcp 2 (cache over 4 ranks): Qwen3 fp8 through Inductor (before `cp::lse_rescale`
    returned contiguous outputs, Inductor's stride assert failed here, any kv_cache_dtype), MLA
    int8 aot_eager."""
    check_pcp_models([_case("qwen3", 2, 2, 2, "inductor", kv_cache_dtype="fp8_e4m3"),
                      _case("mla", 2, 2, 2, "aot_eager", interleave=BLOCK, kv_cache_dtype="int8")])


@pytest.mark.slow
def test_pcp2_tp2_models_match_single_device():
    """World 4 (tp = 2, pcp = 2): plain TP, TP + DCP (cache over pcp * dcp = 4 ranks), interleave = block."""
    check_pcp_models([
        _case("qwen3", 2, 1, 2, "inductor", num_kv_heads=2),
        _case("mla", 2, 1, 2, "eager"),
        _case("qwen3", 2, 2, 2, "eager", interleave=BLOCK),
        _case("mla", 2, 2, 2, "inductor"),
        _case("mla", 2, 2, 2, "aot_eager", interleave=BLOCK),
        _case("qwen3", 2, 2, 2, "inductor"),
    ])


@pytest.mark.slow
@pytest.mark.parametrize("tp,dcp", [(1, 1), (2, 2)])
def test_pcp2_decode_projected_before_the_merge(tp: int, dcp: int):
    """MLA at pcp = 2 with dcp_project_before_merge="on": the decode graph is the DCP decode over
    the cp group (N = pcp * dcp), so W_UV moves before its merge, gathered over the cp ranks in cp
    rank order (the partial's head order): at tp = dcp = 1 the PCP peer's copy of the same heads,
    at tp = dcp = 2 (world 4) the four cp ranks' two distinct head sets, so the order matters.
    Every step equals one device (decision 73)."""
    check_pcp_models([_case("deepseek_v3", tp, dcp, 2, "aot_eager", cfg_kw={"dcp_project_before_merge": "on"})])
