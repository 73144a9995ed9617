"""Speculative decoding under DCP / PCP on real gloo ranks: greedy output with
speculation == greedy output without it (single device), token for token.

Each case runs the example target with its proposer (GQA: a tiny random draft
model; MLA / SFA: the DeepSeek-V3 MTP layer, read from HF-named
`model.layers.{num_layers}.*` tensors) compiled with `cp_compile.compile_model`: the
target's verify steps (k + 1 tokens per request) run in their own graph on the
sharded cache. Checked on every rank:

- the generated tokens equal the single-device greedy run *without* speculation;
- the per-step acceptance counts equal the single-device speculative run's (same
  drafts: the draft cache is sharded like the target's and read through the same
  block tables);
- rollback: after every verify step the test writes NaN into every stale slot (the
  rejected positions of the target's and the draft's cache, on this rank's shard,
  including blocks given back) from its own account of what is stale, and the
  result is unchanged; each request then holds exactly the blocks its committed
  tokens need, and all blocks are free at the end;
- graphs: one per model and batch kind in eager lowering; Inductor may specialise
  once more while the batch shrinks in the first generation; a second generation
  on the same compiled models under `fail_on_recompile` (other prompts, other
  acceptance, every round a different set of lengths) compiles nothing.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import cp_compile
from cp_compile.ops.layout import local_slot_mapping
from cp_compile.spec_decode import Rollback
from cp_compile.testing.multirank import run_on_ranks
from examples import spec
from examples.models.tiny import VOCAB, hf_deepseek_sfa, hf_deepseek_v3, hf_qwen3

BLOCK = 4
NUM_BLOCKS = 40
MAX_BLOCKS = 10
PAD = 1
MAX_NEW = 10
PROMPT_LENS = {0: 7, 1: 3, 2: 12}


def _prompts(seed: int = 0) -> dict[int, list[int]]:
    g = torch.Generator().manual_seed(seed)
    return {r: torch.randint(0, VOCAB, (n,), generator=g).tolist() for r, n in PROMPT_LENS.items()}


def _hf(kind: str, tp: int, dcp: int):
    heads = max(4, tp)
    if kind == "qwen3":
        return hf_qwen3(num_kv_heads=max(1, tp // dcp), num_heads=heads)
    if kind == "sfa":
        return hf_deepseek_sfa("deepseek_v32", num_heads=heads)
    return hf_deepseek_v3(q_lora_rank=None, num_heads=heads)


def _true_stale(r: Rollback, k: int, proposer: str) -> tuple[range, range]:
    """The stale positions as the test counts them (not as the runner reports them).

    Target: the verify step wrote old_len - 1 .. old_len - 1 + k and kept a + 1 of them.
    Token draft: wrote up to old_len + k - 2, exact through the a accepted drafts (<= k - 1).
    MTP: wrote up to old_len + k - 3; only the positions fed by the target (< old_len - 1) are exact.
    """
    a = r.num_accepted
    target = range(r.old_len + a, r.old_len + k)
    if proposer == "mtp":
        return target, range(r.old_len - 1, r.old_len + k - 2)
    return target, range(r.old_len + min(a, k - 1), r.old_len + k - 1)


def _poisoner(cfg: cp_compile.CPConfig, cp_rank: int, models: spec.SpecModels, k: int, proposer: str,
              alloc_holder: dict) -> Any:
    vbs = cfg.virtual_block_size
    n = cfg.context_parallel_size

    def poison(caches: list[tuple[torch.Tensor, ...]], table: list[int], positions: range) -> None:
        pos = torch.tensor([p for p in positions if p // vbs < len(table)], dtype=torch.int64)
        if pos.numel() == 0:
            return
        slots = torch.tensor(table)[pos // vbs] * vbs + pos % vbs  # global slots
        local = local_slot_mapping(slots, cp=n, rank=cp_rank, interleave=cfg.cp_kv_cache_interleave_size,
                                   block_size=cfg.block_size)
        local = local[local >= 0]
        for layer in caches:
            for t in layer:  # K and V, or the latent: this rank's shard; SFA's indexer cache: every token
                sharded = t.shape[1] == cfg.block_size
                t.view(-1, *t.shape[2:])[local if sharded else slots] = float("nan")

    def on_rollback(r: Rollback) -> None:
        alloc = alloc_holder["alloc"]
        length = r.old_len + r.num_accepted + 1
        assert alloc.blocks(r.req_id) == r.block_table[: -(-length // vbs)], "blocks past the tokens not freed"
        assert r.freed == r.block_table[-(-length // vbs):]
        target, draft = _true_stale(r, k, proposer)
        poison(models.target_caches, r.block_table, target)
        poison(models.proposer.kv_caches, r.block_table, draft)

    return on_rollback


def _world(rank: int, world: int, cases: list[dict]) -> list[dict]:
    outs = []
    for c in cases:
        cfg = cp_compile.CPConfig(tensor_parallel_size=c["tp"], decode_context_parallel_size=c["dcp"],
                                  prefill_context_parallel_size=c["pcp"],
                                  cp_kv_cache_interleave_size=c["interleave"], block_size=BLOCK)
        state = cp_compile.init_parallel(cfg, device="cpu")
        models = spec.build(cfg, c["hf_config"], c["state_dict"], c["proposer"], c["k"], NUM_BLOCKS,
                            state.tp_rank, state.tp_group, lowering=c["lowering"],
                            draft_lowering=c["draft_lowering"], draft_hf=c["draft_hf"], padding=PAD,
                            max_blocks_per_req=MAX_BLOCKS)
        nan_seen = []  # did the proposer ever produce NaN logits (read a poisoned slot)?
        inner = models.proposer.forward

        def watched(*args: Any) -> Any:
            out = inner(*args)
            nan_seen.append(bool(torch.isnan(out[0] if isinstance(out, tuple) else out).any()))
            return out

        models.proposer.forward = watched
        holder: dict = {}
        hook = _poisoner(cfg, state.cp_rank, models, c["k"], c["proposer"], holder) if c["poison"] else None
        dec = spec.decoder(models, cfg, NUM_BLOCKS, padding=PAD, max_blocks_per_req=MAX_BLOCKS, on_rollback=hook)
        holder["alloc"] = dec.alloc
        res = dec.generate(_prompts(), MAX_NEW)
        assert dec.alloc.num_free == NUM_BLOCKS  # every block back once the requests finished
        graphs = models.graphs()
        again = None
        if c.get("second_run"):
            torch.compiler.set_stance("fail_on_recompile")
            try:
                again = spec.decoder(models, cfg, NUM_BLOCKS, padding=PAD, max_blocks_per_req=MAX_BLOCKS
                                     ).generate(_prompts(seed=1), MAX_NEW)
            finally:
                torch.compiler.set_stance("default")
        kinds = {name: {kind: [ctx.batch_kind for ctx in b.contexts] for kind, b in comp.backends.items()}
                 for name, comp in models.compiled.items()}
        outs.append(dict(draft_nan=any(nan_seen), tokens=res.tokens, accepted=res.stats.accepted_per_step, graphs=graphs, kinds=kinds,
                         again=None if again is None else again.tokens, rate=res.stats.acceptance_rate,
                         tps=res.stats.tokens_per_step))
        cp_compile.destroy_parallel()
        torch._dynamo.reset()
    return outs


def _reference(c: dict, prompts: dict[int, list[int]], k: int) -> Any:
    """Single device, eager: without speculation (k = 0) or with it."""
    cfg = cp_compile.CPConfig(block_size=BLOCK * c["dcp"] * c["pcp"])
    models = spec.build(cfg, c["hf_config"], c["state_dict"], c["proposer"] if k else None, k, NUM_BLOCKS,
                        draft_hf=c["draft_hf"], padding=PAD, max_blocks_per_req=MAX_BLOCKS)
    return spec.decoder(models, cfg, NUM_BLOCKS, padding=PAD, max_blocks_per_req=MAX_BLOCKS).generate(prompts, MAX_NEW)


def case(kind: str, tp: int, dcp: int, pcp: int = 1, lowering: str = "eager", k: int = 2, interleave: int = 1,
         draft_lowering: str | None = None, poison: bool = True, second_run: bool = False,
         proposer: str | None = None) -> dict:
    hf = _hf(kind, tp, dcp)
    proposer = proposer or spec.default_proposer(hf.config.model_type)
    sd = {n: v.detach().clone() for n, v in hf.state_dict().items()}
    sd, dcfg, dsd = spec.proposer_weights(proposer, hf.config, sd)
    return dict(kind=kind, tp=tp, dcp=dcp, pcp=pcp, lowering=lowering, k=k, interleave=interleave,
                draft_lowering=draft_lowering or lowering, poison=poison, second_run=second_run,
                proposer=proposer, hf_config=hf.config, state_dict=sd,
                draft_hf=None if dcfg is None else (dcfg, dsd))


def name(c: dict) -> str:
    return (f"{c['kind']}+{c['proposer']} tp={c['tp']} dcp={c['dcp']} pcp={c['pcp']} I={c['interleave']} "
            f"{c['lowering']}/{c['draft_lowering']} k={c['k']}")


def run_cases(cases: list[dict]) -> list[tuple[dict, dict, Any, Any]]:
    """Run `cases` (one world size) in one spawned world; (case, rank-0 result, reference
    without speculation, single-device speculative run) per case, every rank checked."""
    world = cases[0]["tp"] * cases[0]["pcp"]
    per_rank = run_on_ranks(_world, world, cases, timeout=1500)
    rows = []
    for i, c in enumerate(cases):
        base, ref_spec = _reference(c, _prompts(), 0), _reference(c, _prompts(), c["k"])
        assert ref_spec.tokens == base.tokens, f"{name(c)}: single-device speculation changed the tokens"
        for rank, outs in enumerate(per_rank):
            out = outs[i]
            assert out["tokens"] == base.tokens, f"{name(c)} rank {rank}"
            assert not out["draft_nan"], f"{name(c)} rank {rank}: the proposer read a poisoned slot"
            assert out["accepted"] == ref_spec.stats.accepted_per_step, f"{name(c)} rank {rank}: drafts differ"
            if out["again"] is not None:
                assert out["again"] == _reference(c, _prompts(seed=1), 0).tokens, f"{name(c)} rank {rank} run 2"
            for model, by_kind in out["graphs"].items():  # one graph per kind (Inductor: see below)
                limit = 1 if (c["lowering"] if model == "target" else c["draft_lowering"]) != "inductor" else 2
                assert all(n <= limit for n in by_kind.values()), (name(c), model, by_kind)
                assert "verify" in by_kind, (name(c), model, by_kind)
        rows.append((c, per_rank[0][i], base, ref_spec))
        r = per_rank[0][i]
        print(f"\nspec {name(c)}: tokens equal, acceptance {r['rate']:.2f}, tokens/step {r['tps']:.2f}, "
              f"graphs {r['graphs']}")
    return rows


def test_spec_decode_dcp2_greedy_equals_no_speculation():
    """tp 2, dcp 2: GQA + draft model (target Inductor, draft eager, k 3, interleave 1, a second
    generation under fail_on_recompile) and MLA + MTP (eager, k 2, interleave 2); rollback poisoned."""
    rows = run_cases([case("qwen3", 2, 2, lowering="inductor", draft_lowering="eager", k=3, second_run=True),
                      case("mla", 2, 2, k=2, interleave=2)])
    kinds = rows[0][1]["kinds"]
    # Each backend compiles only its own kind (Inductor may run the verify graph's passes twice).
    assert {k: set(v) for k, v in kinds["target"].items()} == {None: {None}, "verify": {"verify"}}, kinds


@pytest.mark.slow
@pytest.mark.parametrize("lowering", ["eager", "inductor"])
def test_spec_decode_table_tp2(lowering):
    """World 2: GQA / MLA / SFA at dcp 2 and plain TP, k 1 and 3, interleave 1 and block."""
    run_cases([case("qwen3", 2, 2, lowering=lowering, k=1), case("qwen3", 2, 2, lowering=lowering, k=3,
                                                                 interleave=BLOCK),
               case("qwen3", 2, 2, lowering=lowering, k=2, proposer="layer_skip"),
               case("mla", 2, 2, lowering=lowering, k=1), case("mla", 2, 2, lowering=lowering, k=3),
               case("sfa", 2, 2, lowering=lowering, k=2), case("mla", 2, 1, lowering=lowering, k=2)])


@pytest.mark.slow
@pytest.mark.parametrize("lowering", ["eager", "inductor"])
def test_spec_decode_table_pcp2_dcp2(lowering):
    """World 4: pcp 2 + dcp 2 (tp 2; the cache over 4 ranks, verify in the decode-like graph) and dcp 4."""
    run_cases([case("qwen3", 2, 2, pcp=2, lowering=lowering, k=2), case("mla", 2, 2, pcp=2, lowering=lowering, k=3),
               case("qwen3", 2, 2, pcp=2, lowering=lowering, k=1, interleave=BLOCK),
               case("mla", 4, 4, lowering=lowering, k=2), case("qwen3", 4, 4, lowering=lowering, k=3)])
