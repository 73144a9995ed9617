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
- drafts with real acceptance: random tiny proposers accept ~0 of their drafts, so
  the test's oracle (`_Oracle`) overwrites the proposer's output logits with the
  target's own greedy tokens, about one in three corrupted at fixed positions; the
  proposer still runs, writing and reading its sharded cache, and its raw logits must
  equal the single-device run's, call by call (tolerance) and hold no NaN. Every case
  sees rounds of 0, some and all k drafts accepted;
- rollback: after every verify step the test writes a poison into every stale slot
  (the rejected positions of the target's and the draft's cache, on this rank's
  shard, including blocks given back) from its own account of what is stale, and the
  result is unchanged; each request then holds exactly the blocks its committed
  tokens need, and all blocks are free at the end. Two poisons: NaN (a stale read
  shows as NaN, or, through an LSE merge that drops NaN partials, as wrong logits;
  it also checks that NaN garbage in masked slots past seq_len spoils no attention
  partial: it caught that in the CPU attention kernels, issue 26) and a large finite
  value (`POISON`: wrong logits exactly where a stale slot is attended);
- graphs: exactly one per model and batch kind, eager and Inductor (Dynamo compiles
  each once: `decorator.only_marked_dims_dynamic`); a second generation on the same
  compiled models under `fail_on_recompile` (other prompts, other acceptance, every
  round a different set of lengths) compiles nothing.

The poison's power: an injected fault (`_mtp_keeps_draft_positions`: the MTP layer
keeps entries of its cache computed from its own hidden states, so its next step
attends stale slots) fails the poisoned run on the proposer's own logits (the greedy
tokens and the oracle's drafts are unaffected). A NaN check on the outputs alone
would not have shown such a read: the DCP merge used to read a NaN partial (a shard
holding an attended poisoned slot) as empty, which yielded finite, wrong logits (since
decision 47 it propagates NaN); hence the call-by-call comparison with the single-device run.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import cp_compile
from cp_compile.ops.core.layout import local_slot_mapping
from cp_compile.serving.spec_decode import Rollback
from cp_compile.testing.multirank import run_on_ranks
from examples import spec
from examples.models.tiny import VOCAB, hf_deepseek_sfa, hf_deepseek_v3, hf_qwen3

BLOCK = 4
NUM_BLOCKS = 40
MAX_BLOCKS = 10
PAD = 1
MAX_NEW = 10
PROMPT_LENS = {0: 7, 1: 3, 2: 12}
# The finite poison written into stale slots: it changes the logits only where a stale slot
# is really attended. (NaN also tests the kernels: one in a masked slot past seq_len must not
# turn a KV chunk's partial into NaN, which the LSE merge would drop as empty.)
POISON = 1.0e4
POISONS = {"nan": float("nan"), "finite": POISON}


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


def _corrupt(rid: int, pos: int) -> bool:
    """Whether the oracle proposes a wrong token for position `pos` of request `rid` (~30 %)."""
    return ((rid + 1) * 7919 + pos * 104729) % 10 < 3


class _Oracle:
    """Wraps a proposer's forward: records whether its raw logits hold NaN, then makes
    each request's last row pick the reference greedy token of the position it
    predicts (+ 1 where `_corrupt`). `seqs`: request -> prompt + greedy tokens."""

    def __init__(self, proposer: Any, seqs: dict[int, list[int]] | None) -> None:
        self.inner, self.shift, self.seqs = proposer.forward, proposer.shift, seqs
        self.nan_seen = False
        self.raw: list[torch.Tensor] = []  # [B, V] raw logits of each call's last rows
        self.rids: list[int] = []
        propose = proposer.propose

        def remember_rids(rids: list[int], *args: Any, **kwargs: Any) -> Any:
            self.rids = list(rids)
            return propose(rids, *args, **kwargs)

        proposer.propose, proposer.forward = remember_rids, self

    def __call__(self, *args: Any) -> Any:
        out = self.inner(*args)
        logits = out[0] if isinstance(out, tuple) else out
        self.nan_seen |= bool(torch.isnan(logits).any())
        positions, meta = args[1], args[-1]
        rows = (meta.query_start_loc[1:].long() - 1).tolist()
        self.raw.append(logits[rows].detach().float().clone())
        if self.seqs is None:
            return out
        logits = torch.zeros_like(logits)
        for rid, row in zip(self.rids, rows):
            pos = int(positions[row]) + 1 + self.shift  # the position this row's token goes to
            seq = self.seqs[rid]
            tok = seq[pos] if pos < len(seq) else 0
            logits[row, (tok + 1) % VOCAB if _corrupt(rid, pos) else tok] = 1.0
        return (logits, out[1]) if isinstance(out, tuple) else logits


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
              alloc_holder: dict, kind: str) -> Any:
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
            for t in layer:  # K and V, or the latent: this rank's shard; SFA's indexer cache: every token;
                # a quantised cache's codes (the largest code) and scales (the poison)
                sharded = t.shape[1] == cfg.block_size
                t.view(-1, *t.shape[2:])[local if sharded else slots] = _poison_value(t, kind)

    def on_rollback(r: Rollback) -> None:
        alloc = alloc_holder["alloc"]
        length = r.old_len + r.num_accepted + 1
        assert alloc.blocks(r.req_id) == r.block_table[: -(-length // vbs)], "blocks past the tokens not freed"
        assert r.freed == r.block_table[-(-length // vbs):]
        target, draft = _true_stale(r, k, proposer)
        poison(models.target_caches, r.block_table, target)
        poison(models.proposer.kv_caches, r.block_table, draft)

    return on_rollback


def _poison_value(t: torch.Tensor, kind: str) -> float:
    """The poison for a cache tensor: POISONS[kind], except in a quantised cache's pages
    (int8 / fp8 codes hold no NaN nor 1e4): the largest code, which its scale (poisoned
    too) turns into NaN or a huge value."""
    if t.dtype == torch.int8:
        return 127.0
    if t.dtype == torch.float8_e4m3fn:
        return 448.0
    return POISONS[kind]


def _world(rank: int, world: int, cases: list[dict]) -> list[dict]:
    outs = []
    for c in cases:
        cfg = cp_compile.CPConfig(tensor_parallel_size=c["tp"], decode_context_parallel_size=c["dcp"],
                                  prefill_context_parallel_size=c["pcp"],
                                  cp_kv_cache_interleave_size=c["interleave"], block_size=BLOCK,
                                  dcp_merge=c["merge"], kv_cache_dtype=c.get("kv_cache_dtype", "auto"))
        state = cp_compile.init_parallel(cfg, device="cpu")
        models = spec.build(cfg, c["hf_config"], c["state_dict"], c["proposer"], c["k"], NUM_BLOCKS,
                            state.layout.tp.rank, state.tp_group, lowering=c["lowering"],
                            draft_lowering=c["draft_lowering"], draft_hf=c["draft_hf"], padding=PAD,
                            max_blocks_per_req=MAX_BLOCKS)
        oracle = _Oracle(models.proposer, c["oracle"][0] if c["oracle"] else None)
        if c["fault"] == "mtp_keeps_draft_positions":
            _mtp_keeps_draft_positions(models.proposer)
        holder: dict = {}
        hook = (_poisoner(cfg, state.layout.cp.rank, models, c["k"], c["proposer"], holder, c["poison"])
                if c["poison"] else None)
        dec = spec.decoder(models, cfg, NUM_BLOCKS, padding=PAD, max_blocks_per_req=MAX_BLOCKS, on_rollback=hook)
        holder["alloc"] = dec.alloc
        res = dec.generate(_prompts(), MAX_NEW)
        raw = list(oracle.raw)  # the first generation's calls (the single-device run has them too)
        assert dec.alloc.num_free == NUM_BLOCKS  # every block back once the requests finished
        graphs = models.graphs()
        again = None
        if c.get("second_run"):
            oracle.seqs = c["oracle"][1] if c["oracle"] else None
            torch.compiler.set_stance("fail_on_recompile")
            try:
                again = spec.decoder(models, cfg, NUM_BLOCKS, padding=PAD, max_blocks_per_req=MAX_BLOCKS
                                     ).generate(_prompts(seed=1), MAX_NEW)
            finally:
                torch.compiler.set_stance("default")
        kinds = {name: {kind: [ctx.batch_kind for ctx in b.contexts] for kind, b in comp.backends.items()}
                 for name, comp in models.compiled.items()}
        outs.append(dict(draft_nan=oracle.nan_seen, raw=raw, tokens=res.tokens, accepted=res.stats.accepted_per_step, graphs=graphs, kinds=kinds,
                         again=None if again is None else again.tokens, rate=res.stats.acceptance_rate,
                         tps=res.stats.tokens_per_step))
        cp_compile.destroy_parallel()
        torch._dynamo.reset()
    return outs


def _mtp_keeps_draft_positions(proposer: Any) -> None:
    """The injected fault: the MTP layer keeps min(a, k - 1) of its draft-step positions
    after `a` accepts, as a token draft may (`DraftProposer.after_verify`); but those
    entries were computed from the MTP's own hidden states, not the target's, so they
    are stale and its next step attends them."""
    after_verify = proposer.after_verify

    def faulty(rid: int, old_len: int, num_accepted: int) -> tuple[int, int]:
        first, last = after_verify(rid, old_len, num_accepted)
        proposer.valid[rid] = first + min(num_accepted, proposer.k - 1)
        return first, last

    proposer.after_verify = faulty


def _reference(c: dict, prompts: dict[int, list[int]], k: int, oracle: dict[int, list[int]] | None = None) -> Any:
    """Single device, eager: without speculation (k = 0) or with it (drafts from `oracle`)."""
    cfg = cp_compile.CPConfig(block_size=BLOCK * c["dcp"] * c["pcp"], kv_cache_dtype=c.get("kv_cache_dtype", "auto"))
    models = spec.build(cfg, c["hf_config"], c["state_dict"], c["proposer"] if k else None, k, NUM_BLOCKS,
                        draft_hf=c["draft_hf"], padding=PAD, max_blocks_per_req=MAX_BLOCKS)
    if k:
        _Oracle(models.proposer, oracle)
    res = spec.decoder(models, cfg, NUM_BLOCKS, padding=PAD, max_blocks_per_req=MAX_BLOCKS).generate(prompts, MAX_NEW)
    res.raw = models.proposer.forward.raw if k else []  # type: ignore[attr-defined]
    return res


def case(kind: str, tp: int, dcp: int, pcp: int = 1, lowering: str = "eager", k: int = 2, interleave: int = 1,
         draft_lowering: str | None = None, poison: str | None = "finite", second_run: bool = False,
         proposer: str | None = None, oracle: bool = True, fault: str | None = None, merge: str = "auto",
         kv_cache_dtype: str = "auto") -> dict:
    """One row of the table; oracle False: the proposer's own drafts (random weights
    accept ~0); poison "nan", "finite" or None; fault "mtp_keeps_draft_positions":
    `_mtp_keeps_draft_positions`; merge: `CPConfig.dcp_merge`; kv_cache_dtype: the target's
    and the proposer's caches, and the single-device references' (lowering None: uncompiled)."""
    if poison not in (None, *POISONS):
        raise ValueError(f"poison={poison!r}: use None, " + " or ".join(map(repr, POISONS)))
    hf = _hf(kind, tp, dcp)
    proposer = proposer or spec.default_proposer(hf.config.model_type)
    sd = {n: v.detach().clone() for n, v in hf.state_dict().items()}
    sd, dcfg, dsd = spec.proposer_weights(proposer, hf.config, sd)
    return dict(kind=kind, tp=tp, dcp=dcp, pcp=pcp, lowering=lowering, k=k, interleave=interleave,
                draft_lowering=draft_lowering or lowering, poison=poison, second_run=second_run,
                proposer=proposer, hf_config=hf.config, state_dict=sd, oracle=oracle, fault=fault, merge=merge,
                kv_cache_dtype=kv_cache_dtype,
                draft_hf=None if dcfg is None else (dcfg, dsd))


def name(c: dict) -> str:
    return (f"{c['kind']}+{c['proposer']} tp={c['tp']} dcp={c['dcp']} pcp={c['pcp']} I={c['interleave']} "
            f"{c['lowering']}/{c['draft_lowering']} k={c['k']} merge={c['merge']} poison={c['poison']} "
            f"drafts={'oracle' if c['oracle'] else 'own'}" + (f" fault={c['fault']}" if c["fault"] else "")
            + (f" kv={c['kv_cache_dtype']}" if c.get("kv_cache_dtype", "auto") != "auto" else ""))


def _full(prompts: dict[int, list[int]], generated: dict[int, list[int]]) -> dict[int, list[int]]:
    return {r: prompts[r] + generated[r] for r in prompts}


def evaluate_cases(cases: list[dict]) -> list[tuple[dict, dict, list[str]]]:
    """Run `cases` (one world size) in one spawned world; (case, rank-0 result, what failed)
    per case, every rank checked against single-device references."""
    refs = []
    for c in cases:  # references first: the oracle proposes the greedy tokens
        base = _reference(c, _prompts(), 0)
        again = _reference(c, _prompts(seed=1), 0) if c["second_run"] else None
        if c["oracle"]:
            c["oracle"] = (_full(_prompts(), base.tokens), again and _full(_prompts(seed=1), again.tokens))
        refs.append((base, again, _reference(c, _prompts(), c["k"], c["oracle"][0] if c["oracle"] else None)))
    world = cases[0]["tp"] * cases[0]["pcp"]
    per_rank = run_on_ranks(_world, world, cases, timeout=1500)
    rows = []
    for i, (c, (base, again, ref_spec)) in enumerate(zip(cases, refs)):
        bad = []
        if ref_spec.tokens != base.tokens:
            bad.append(f"{name(c)}: single-device speculation changed the tokens")
        seen = {a for step in ref_spec.stats.accepted_per_step for a in step}
        if c["oracle"] and not ({0, c["k"]} <= seen and (c["k"] < 2 or seen & set(range(1, c["k"])))):
            bad.append(f"{name(c)}: the oracle's drafts did not give 0, some and all accepted: {sorted(seen)}")
        for rank, outs in enumerate(per_rank):
            out = outs[i]
            if out["tokens"] != base.tokens:
                bad.append(f"{name(c)} rank {rank}: tokens differ")
            if out["draft_nan"]:
                bad.append(f"{name(c)} rank {rank}: the proposer read a poisoned slot")
            if out["accepted"] != ref_spec.stats.accepted_per_step:
                bad.append(f"{name(c)} rank {rank}: drafts differ")
            if len(out["raw"]) != len(ref_spec.raw):
                bad.append(f"{name(c)} rank {rank}: {len(out['raw'])} proposer calls, single device "
                           f"{len(ref_spec.raw)}")
            else:
                differ = {j: round((a - b).abs().max().item(), 4) for j, (a, b) in enumerate(zip(out["raw"], ref_spec.raw))
                          if not torch.allclose(a, b, rtol=1e-3, atol=1e-3)}
                if differ:
                    bad.append(f"{name(c)} rank {rank}: proposer logits differ from the single-device run's "
                               f"(call: max abs difference) {differ}")
            if out["again"] is not None and out["again"] != again.tokens:
                bad.append(f"{name(c)} rank {rank}: run 2 tokens differ")
            for model, by_kind in out["graphs"].items():  # one graph per kind, Inductor too (0: kind unused)
                if not all(n <= 1 for n in by_kind.values()) or "verify" not in by_kind:
                    bad.append(f"{name(c)} rank {rank}: graphs of {model}: {by_kind}")
        r = per_rank[0][i]
        print(f"\nspec {name(c)}: {'FAILED ' + '; '.join(bad) if bad else 'tokens equal'}, acceptance "
              f"{r['rate']:.2f}, tokens/step {r['tps']:.2f}, accepted {r['accepted']}, graphs {r['graphs']}")
        rows.append((c, r, bad))
    return rows


def run_cases(cases: list[dict]) -> list[tuple[dict, dict, list[str]]]:
    """`evaluate_cases`, every check passed."""
    rows = evaluate_cases(cases)
    failed = [f for _, _, bad in rows for f in bad]
    assert not failed, failed
    return rows


FAULT = "mtp_keeps_draft_positions"


def test_spec_decode_dcp2_greedy_equals_no_speculation():
    """tp 2, dcp 2, in one world:
    - GQA + the random draft model's own drafts (target Inductor with the A2A merge in its
      verify graph, draft eager, k 3, interleave 1, NaN poison, a second generation under
      fail_on_recompile);
    - MLA + MTP with the oracle's drafts (eager, k 2, interleave 2, finite poison): rounds
      of 0, some and all drafts accepted;
    - the poison's power: MLA + MTP (k 3) with the injected fault fails, on the proposer's
      logits alone."""
    rows = evaluate_cases([case("qwen3", 2, 2, lowering="inductor", draft_lowering="eager", k=3, second_run=True,
                                oracle=False, poison="nan", merge="a2a"),
                           case("mla", 2, 2, k=2, interleave=2), case("mla", 2, 2, k=3, fault=FAULT)])
    assert rows[0][2] == [] and rows[1][2] == [], rows[0][2] + rows[1][2]
    faulty = rows[2][2]  # only the proposer's own logits show it: greedy tokens and the oracle's drafts hold
    assert faulty and all("poisoned slot" in f or "proposer logits differ" in f for f in faulty), faulty
    kinds = rows[0][1]["kinds"]
    # Each backend compiles its own kind once (Inductor target: one verify compile, no restart).
    assert kinds["target"] == {None: [None], "verify": ["verify"]}, kinds


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
