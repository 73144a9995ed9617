"""Config-space fuzz at model level (issues 19, 35): every drawn configuration is either
refused by a `ConfigError` before any step, or matches the single-device model.

A case draws the attention kind (GQA / MLA / SFA), query heads, KV heads, head dims,
tp / dcp / pcp within the world (2 or 4 gloo ranks), interleave, block size, merge
(ag_rs / a2a / replicate), DSA-CP, the lowering (eager / aot_eager), speculative
decoding (k verify tokens) and a random schedule of prefill, chunked prefill, decode,
mixed and (with k > 0) verify steps of up to k + 1 tokens per request (teacher-forced:
the token ids are drawn up front, so the reference and the ranks run the same inputs
whatever they predict). On the ranks the example model is built, its cache allocated
and `compile_model` runs the schedule; the reference is the single-device eager model
with pages of a whole virtual block. Accepted: a `ConfigError` raised before the first
step completed with the caches still all zero; or every step's logits of every real
token within 1e-4 (fp32) and the same greedy tokens on every rank. The case seed is in
every failure message; rerun one with `CP_FUZZ_SEEDS=<seed>` (with the default draw's
pins when the seed is one of `DEFAULT_DRAW`'s).

Default draw (`DEFAULT_DRAW`, issue 35 item 7): a few random cases, each with some
axes pinned so that together they cover every family and axis in `REQUIRED_AXES`
(GQA / MLA / SFA DCP, DSA-CP, PCP with DCP, each merge, interleave 1 and = block size,
verify steps with k >= 2); the rest of each case is drawn from its seed. Coverage is
read from what ran, not from the pins: a case counts for an axis only if it ran (not
refused), matched one device, and the pass that implements the axis rewrote its graphs
(the passes' history on the ranks). The test fails if an axis is left uncovered, and
prints (summary note) the axis -> case table and each case's seconds.
CI budget of the default draw: 150 s on the shared 2-core CI box (one 2-rank world for
four cases, one 4-rank world for the PCP case, one pair of 2-rank worlds for the P/D
pair; 1-layer models, eager lowering but one; measured 51-74 s under load before the
P/D pair; with it 558 s at load average 25, where the five other cases took 4-8 times
their earlier figures and the pair 114 s; the pair alone 38 s at load 11; not measured
quiet yet), plus 30 s for `test_fuzz_catches_mla_context_lens`
(measured 9-21 s): the MLA DCP case with issue 35's bug put back in the spawned ranks
must fail the comparison. `-m slow`: a wider random sweep on 2 and 4 ranks with
2-layer models.

P/D disaggregation (`draw_pd`, `fuzz_pd`): a prefill instance at one layout exports
to a decode instance at another (two separate 2-rank worlds, a TCPStore, NIXL over
DRAM; examples/pd_disagg.py's harness): the kind, both layouts (P tp1/pcp2 or tp2 with
dcp 1 or 2, D tp2 with dcp 1 or 2, interleaves, block sizes) and the prompts are drawn
from the seed. Accepted: both layouts refused by `validate_for` before any process
starts, or D's greedy tokens equal to one device on every D rank, every logit (P's
prefill and D's decode steps) within 1e-4, the bytes D read equal to the formula and P
told "ok". The default draw has one pair (`DEFAULT_PD`: 1-layer model, one prompt, 2
decode steps, P uncompiled); `-m slow` draws more. Wider pair matrices and the transfer's faults are
in `tests/cp_compile/test_pd_disagg.py`. Rollback and draft proposers of speculative
decoding are in `tests/spec_decode/test_spec_decode_model.py`; here the verify graphs
run teacher-forced.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import pytest
import torch

import cp_compile
from cp_compile.base.config import ConfigError
from cp_compile.passes import dcp_attention
from cp_compile.runtime.metadata import batch_kind
from cp_compile.testing.multirank import run_on_ranks
from examples.models.tiny import VOCAB, example_from_config, hf_deepseek_sfa, hf_deepseek_v3, hf_qwen3
from examples.pd_disagg import Case as PDCase
from examples.pd_disagg import Side as PDSide
from examples.pd_disagg import check_layouts as pd_check_layouts
from examples.pd_disagg import compare as pd_compare
from examples.pd_disagg import geometry_of as pd_geometry_of
from examples.pd_disagg import reference as pd_reference
from examples.pd_disagg import run_cases as pd_run_cases
from examples.serving import layer_caches

NUM_BLOCKS = 24
MAX_BLOCKS = 12


@dataclass
class Case:
    seed: int
    world: int
    kind: str  # gqa | mla | sfa
    num_heads: int
    num_kv_heads: int
    head_dim: int  # GQA head dim; MLA/SFA: rope dim
    latent: int  # MLA/SFA kv_lora_rank
    tp: int
    dcp: int
    pcp: int
    interleave: int
    block: int
    merge: str
    dsa_cp: bool
    lowering: str
    num_layers: int = 2
    spec_k: int = 0  # speculative tokens: > 0 compiles the verify graph and schedules verify steps
    # steps: per step a list of (request id, new tokens); token ids per request
    steps: list[list[tuple[int, int]]] = field(default_factory=list)
    tokens: dict[int, list[int]] = field(default_factory=dict)
    padding: list[int] = field(default_factory=list)


def draw(seed: int, world: int, num_layers: int = 2, pins: dict[str, Any] | None = None) -> Case:
    """Case `seed` on `world` ranks; `num_layers` is not drawn (the default part runs
    1-layer models: a layer's compile is most of a case's time, and a bug in one
    layer's attention shows in the first).

    `pins` fixes axes by Case field name (interleave may be "block": the drawn block
    size); a pinned axis still consumes its random draw, so the unpinned axes of a seed
    are the same with or without pins, and axes drawn from a pinned one (KV heads from
    the kind, pcp from tp) follow the pinned value."""
    pins = pins or {}
    r = random.Random(seed)

    def pick(name: str, options: Sequence[Any]) -> Any:
        drawn = r.choice(list(options))
        return pins.get(name, drawn)

    kind = pick("kind", ["gqa", "gqa", "mla", "sfa"])
    heads = pick("num_heads", [2, 4, 8])
    kv = pick("num_kv_heads", [h for h in (1, 2, 4) if heads % h == 0]) if kind == "gqa" else heads
    tp = pick("tp", [t for t in (1, 2, 4) if world % t == 0])
    pcp = world // tp
    dcp = pick("dcp", [d for d in (1, 2, 4) if tp % d == 0])
    block = pick("block", [2, 4])
    head_dim = pick("head_dim", [8, 16] if kind == "gqa" else [4, 8])
    latent = pick("latent", [16, 32])
    interleave = pick("interleave", [1, 2, block] if block % 2 == 0 else [1])
    merge = pick("merge", ["ag_rs", "a2a", "replicate"])
    dsa_cp = pins.get("dsa_cp", kind == "sfa" and r.random() < 0.4)
    lowering = pick("lowering", ["eager", "aot_eager"])
    # Speculation from a stream of its own: adding it kept every other axis of a seed.
    spec_k = pins.get("spec_k", random.Random(f"spec-{seed}").choice([0, 0, 2, 3]))
    c = Case(seed=seed, world=world, kind=kind, num_heads=heads, num_kv_heads=kv, head_dim=head_dim, latent=latent,
             tp=tp, dcp=dcp, pcp=pcp, interleave=block if interleave == "block" else interleave, block=block,
             merge=merge, dsa_cp=dsa_cp, lowering=lowering, num_layers=num_layers, spec_k=spec_k)
    # Schedule: requests join with a prompt, run it whole or in chunks, then decode.
    left: dict[int, int] = {}  # request -> prompt tokens not yet run
    n_req = 0
    for _ in range(r.randint(3, 5)):
        step = []
        for rid in list(left):
            if r.random() < 0.15:
                continue  # sits this step out
            new = left[rid] if left[rid] <= 0 else (left[rid] if r.random() < 0.6 else r.randint(1, left[rid]))
            step.append((rid, max(new, 1)))
        while n_req < 4 and (not step or r.random() < 0.4):
            rid, n = n_req, r.randint(1, 11)
            n_req += 1
            left[rid] = n
            first = n if r.random() < 0.7 else r.randint(1, n)
            step.append((rid, first))
        for rid, new in step:
            left[rid] -= new
        c.steps.append(step)
        c.padding.append(r.choice([0, 0, 1, 2]))
    if spec_k:
        _verify_steps(c, left, random.Random(f"verify-{seed}"))
    total: dict[int, int] = {}
    for step in c.steps:
        for rid, new in step:
            total[rid] = total.get(rid, 0) + new
    g = torch.Generator().manual_seed(seed)
    c.tokens = {rid: torch.randint(0, VOCAB, (n,), generator=g).tolist() for rid, n in total.items()}
    return c


def _verify_steps(c: Case, left: dict[int, int], r: random.Random) -> None:
    """Appends the steps speculative decoding runs on the target: every request brings
    its last accepted token and up to k drafts (1 .. k + 1 tokens, the first request
    k + 1 so the step is a verify batch and not a decode one). Prompts still running
    are finished first: a verify batch holds no prompt chunk."""
    if any(n > 0 for n in left.values()):
        c.steps.append([(rid, n) for rid, n in left.items() if n > 0])
        c.padding.append(0)
    for _ in range(2):
        rids = list(left)
        step = [(rid, c.spec_k + 1 if i == 0 else r.randint(1, c.spec_k + 1)) for i, rid in enumerate(rids)]
        c.steps.append(step)
        c.padding.append(r.choice([0, 1]))


def _hf(c: Case):
    if c.kind == "gqa":
        return hf_qwen3(num_kv_heads=c.num_kv_heads, num_heads=c.num_heads, head_dim=c.head_dim,
                        num_layers=c.num_layers)
    if c.kind == "mla":
        return hf_deepseek_v3(q_lora_rank=None, num_heads=c.num_heads, kv_lora_rank=c.latent,
                              qk_rope_head_dim=c.head_dim, num_layers=c.num_layers)
    return hf_deepseek_sfa("deepseek_v32", num_heads=c.num_heads, num_layers=c.num_layers)


StepResult = tuple[torch.Tensor, list[int], str]


def run_case(c: Case, forward: Callable[..., torch.Tensor], layers: list, cfg: cp_compile.CPConfig
             ) -> list[StepResult]:
    """The schedule through forward -> per step (logits of every real token [N, vocab],
    their greedy tokens, the step's batch kind). Every token, not only each request's
    last: a verify step's k + 1 logits are all used."""
    alloc = cp_compile.BlockAllocator(NUM_BLOCKS, cfg.virtual_block_size)
    done: dict[int, int] = {}
    out = []
    for step, pad in zip(c.steps, c.padding):
        reqs = [(done.get(rid, 0), new) for rid, new in step]
        meta = cp_compile.build_attention_metadata(reqs, alloc, req_ids=[rid for rid, _ in step],
                                                   num_padding_tokens=pad, max_blocks_per_req=MAX_BLOCKS)
        ids = [t for (rid, new), (ctx, _) in zip(step, reqs) for t in c.tokens[rid][ctx:ctx + new]] + [0] * pad
        with torch.no_grad():
            logits = forward(torch.tensor(ids), meta.positions, layers, meta)
        real = logits[:int(meta.query_start_loc[-1])].float()
        out.append((real.clone(), real.argmax(-1).tolist(), batch_kind(meta, c.spec_k)))
        for rid, new in step:
            done[rid] = done.get(rid, 0) + new
    return out


def _config(c: Case) -> cp_compile.CPConfig:
    return cp_compile.CPConfig(tensor_parallel_size=c.tp, decode_context_parallel_size=c.dcp,
                               prefill_context_parallel_size=c.pcp, cp_kv_cache_interleave_size=c.interleave,
                               block_size=c.block, dcp_merge=c.merge, enable_dsa_cp=c.dsa_cp)


# Mutations the spawned ranks can apply before compiling (see `test_fuzz_catches_mla_context_lens`).
def _mutate_mla_context_lens() -> None:
    """Issue 35's reverted fix: MLA DCP attends each query's cached-context length
    instead of its causal length (the step's own keys dropped). Applied only in the
    spawned ranks (their own import of the pass), never in the test process."""
    # The pass builds MLA from the pattern's `partial` (then its own merge: project before the
    # merge, decision 61) and calls `composition` where a pattern has no partial: mutate both.
    for attr in ("composition", "partial"):
        original = getattr(dcp_attention.MLAPattern, attr)

        def mutant(*, local: Any, _original: Callable[..., Any] = original, **kwargs: Any) -> Any:
            # The pass calls them with keywords only (passes/dcp_attention.py).
            return _original(**kwargs, local=local._replace(causal_lens=local.context_lens))

        setattr(dcp_attention.MLAPattern, attr, staticmethod(mutant))


MUTATIONS: dict[str, Callable[[], None]] = {"mla_context_lens": _mutate_mla_context_lens}


def _rank(rank: int, world: int, cases: list[tuple[dict, dict, dict]], mutation: str | None = None) -> list[dict]:
    if mutation is not None:
        MUTATIONS[mutation]()
    outs = []
    for case_d, hf_config, sd in cases:
        c = Case(**case_d)
        t0 = time.perf_counter()
        stage = "config"
        layers: list = []
        try:
            cfg = _config(c)
            state = cp_compile.init_parallel(cfg, device="cpu")
            try:
                model = example_from_config(hf_config, sd, c.tp, state.layout.tp.rank, state.tp_group)
                cfg.validate_for(model.attention_spec())
                cache = cp_compile.allocate_kv_cache(cfg, model.kv_cache_spec(), NUM_BLOCKS,
                                                     attention=model.attention_spec())
                layers = layer_caches(cache)
                compiled = cp_compile.compile_model(model, lowering=c.lowering, num_speculative_tokens=c.spec_k)
                stage = "steps"
                res = run_case(c, compiled, layers, cfg)
                # What the passes did, per compiled graph: (pass, rewrites, merge chosen).
                # One backend per batch kind (PCP, DSA-CP, verify graphs), each with its own.
                backends = {id(b): b for b in compiled.backends.values()}.values()
                passes = [(h.name, h.rewrites, (h.decision or {}).get("merge"))
                          for b in backends for pm in b.pass_managers for h in pm.history]
                outs.append(dict(verdict="ran", results=res, passes=passes, secs=time.perf_counter() - t0))
            finally:
                cp_compile.destroy_parallel()
                torch._dynamo.reset()
        except ConfigError as e:
            untouched = all(int(t.count_nonzero()) == 0 for layer in layers for t in layer)
            outs.append(dict(verdict="refused", stage=stage, message=str(e), untouched=untouched,
                             secs=time.perf_counter() - t0))
    return outs


def _reference(c: Case, hf) -> list[StepResult]:
    model = example_from_config(hf.config, hf.state_dict())
    n = c.dcp * c.pcp
    cfg = cp_compile.CPConfig(block_size=c.block * n)
    cache = cp_compile.allocate_kv_cache(cfg, model.kv_cache_spec(), NUM_BLOCKS)
    return run_case(c, model, layer_caches(cache), cfg)


# --------------------------------------------------------------------------- coverage

# Each axis the default draw must cover, and what shows a ran case covered it: the
# passes' history on rank 0 (pass name -> total rewrites; the merges the DCP / PCP
# passes chose for graphs they rewrote) and the steps' batch kinds.
REQUIRED_AXES = ("GQA DCP", "MLA DCP", "SFA DCP", "DSA-CP", "PCP with DCP", "merge ag_rs", "merge a2a",
                 "merge replicate", "interleave 1", "interleave = block", "spec verify k>=2", "P/D layout pair")


def covered_axes(c: Case, out: dict) -> set[str]:
    """The axes a case exercised, from what its ranks ran (empty unless it ran)."""
    if out["verdict"] != "ran":
        return set()
    rewrites: dict[str, int] = {}
    merges: set[str] = set()
    for name, n, merge in out["passes"]:
        rewrites[name] = rewrites.get(name, 0) + n
        if n and merge:
            merges.add(merge)
    axes = {f"merge {m}" for m in merges}
    if rewrites.get("dcp_attention") and c.pcp == 1:
        axes.add(f"{c.kind.upper()} DCP")
    if rewrites.get("sfa_dcp"):
        axes.add("SFA DCP")
    if rewrites.get("dsa_cp"):
        axes.add("DSA-CP")
    if rewrites.get("pcp_attention") and c.dcp > 1:
        axes.add("PCP with DCP")
    if c.dcp * c.pcp > 1:  # interleave only shapes a sharded cache
        axes.add("interleave 1" if c.interleave == 1 else ("interleave = block" if c.interleave == c.block
                                                           else "interleave other"))
    if c.spec_k >= 2 and any(kind == "verify" for _, _, kind in out["results"]):
        axes.add("spec verify k>=2")
    return axes


def describe(c: "Case | PDDraw") -> str:
    if isinstance(c, PDDraw):
        return f"seed {c.seed}: P/D {c.case.name()}, prompts {list(c.case.prompt_lens)}, {c.case.steps} decode steps"
    return (f"seed {c.seed}: {c.kind} w{c.world} tp{c.tp} dcp{c.dcp} pcp{c.pcp} {c.merge} "
            f"il{c.interleave}/bs{c.block}{' dsa_cp' if c.dsa_cp else ''}{f' k{c.spec_k}' if c.spec_k else ''} "
            f"{c.lowering}")


@dataclass
class FuzzReport:
    counts: dict[str, int]
    rows: list[tuple["Case | PDDraw", str, float, set[str]]]  # case, verdict, rank-0 seconds (P/D: the pair's
    # wall time), axes covered
    secs: float

    def coverage(self) -> dict[str, list[int]]:
        return {axis: [c.seed for c, _, _, axes in self.rows if axis in axes] for axis in REQUIRED_AXES}

    def case_lines(self) -> list[str]:
        return [f"  {describe(c)}: {verdict}, {s:.1f} s" for c, verdict, s, _ in self.rows]

    def table(self) -> list[str]:
        return self.case_lines() + [f"  {axis:<20} <- " + (", ".join(f"seed {s}" for s in seeds) or "NOT COVERED")
                                    for axis, seeds in self.coverage().items()]


def fuzz(seeds: list[int] | list[tuple[int, dict[str, Any]]], world: int, num_layers: int = 2,
         mutation: str | None = None) -> FuzzReport:
    """Draws the cases (a seed, or (seed, pins)), runs them all on one spawned world of
    `world` ranks and checks each against one device; raises on the first mismatch."""
    specs = [s if isinstance(s, tuple) else (s, {}) for s in seeds]
    cases = [draw(s, world, num_layers, pins) for s, pins in specs]
    hfs = [_hf(c) for c in cases]
    payload = [(asdict(c), hf.config, {k: v.detach().clone() for k, v in hf.state_dict().items()})
               for c, hf in zip(cases, hfs)]
    t0 = time.perf_counter()
    per_rank = run_on_ranks(_rank, world, payload, mutation, timeout=1800)
    counts = {"ran": 0, "refused": 0}
    rows = []
    for i, (c, hf) in enumerate(zip(cases, hfs)):
        where = f"fuzz case seed={c.seed} world={world} ({CP_FUZZ_RERUN}{c.seed}): {asdict(c)}"
        verdicts = {per_rank[r][i]["verdict"] for r in range(world)}
        assert len(verdicts) == 1, f"ranks disagree {verdicts}: {where}"
        first = per_rank[0][i]
        counts[first["verdict"]] += 1
        verdict = first["verdict"] if first["verdict"] == "ran" else f"refused ({first['message'][:200]})"
        rows.append((c, verdict, first["secs"], covered_axes(c, first)))
        if first["verdict"] == "refused":
            for r in range(world):
                o = per_rank[r][i]
                assert o["stage"] == "config" or o["untouched"], \
                    f"refused after a cache write on rank {r} ({o['message']}): {where}"
            continue
        ref = _reference(c, hf)
        for r in range(world):
            for s, ((got, gt, _), (want, wt, _)) in enumerate(zip(per_rank[r][i]["results"], ref, strict=True)):
                torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4,
                                           msg=lambda m: f"rank {r} step {s} {c.steps[s]}: {m}\n{where}")
                assert gt == wt, f"rank {r} step {s}: greedy tokens {gt} != {wt}: {where}"
    report = FuzzReport(counts, rows, time.perf_counter() - t0)
    print(f"\nconfig fuzz (world {world}): {len(cases)} cases, {counts['ran']} ran and matched one device, "
          f"{counts['refused']} refused before any step; {report.secs:.0f} s\n" + "\n".join(report.table()))
    return report


# --------------------------------------------------------------------------- P/D layout pairs


@dataclass(frozen=True)
class PDDraw:
    """A drawn P/D layout pair: `case` is examples.pd_disagg's (kind, P side, D side, prompts)."""

    seed: int
    case: PDCase


def draw_pd(seed: int, num_layers: int = 1, pins: dict[str, Any] | None = None) -> PDDraw:
    """P/D pair `seed` on a 2-rank P world and a 2-rank D world. `pins` fixes axes by
    name (kind, p_tp, p_dcp, p_interleave, p_block, d_dcp, d_interleave, d_block; an
    interleave may be "block"); a pinned axis still consumes its draw, as in `draw`."""
    pins = pins or {}
    r = random.Random(f"pd-{seed}")

    def pick(name: str, options: Sequence[Any]) -> Any:
        drawn = r.choice(list(options))
        return pins.get(name, drawn)

    kind = pick("kind", ["gqa", "mla", "sfa"])
    p_tp = pick("p_tp", [1, 2])
    p_dcp = pick("p_dcp", [1, 2]) if p_tp == 2 else (pick("p_dcp", [1, 2]), 1)[1]  # tp 1: pcp 2, dcp 1
    p_block, d_block = pick("p_block", [4, 8]), pick("d_block", [4, 8])
    p_il, d_il = pick("p_interleave", [1, "block"]), pick("d_interleave", [1, "block"])
    d_dcp = pick("d_dcp", [1, 2])
    prompts = tuple(r.randint(3, 13) for _ in range(r.randint(1, 2)))
    p = PDSide(p_tp, 2 // p_tp, p_dcp, p_block if p_il == "block" else p_il, p_block)
    d = PDSide(2, 1, d_dcp, d_block if d_il == "block" else d_il, d_block)
    return PDDraw(seed, PDCase(kind, p, d, prompt_lens=prompts, steps=2, num_layers=num_layers))


def fuzz_pd(draws: list[tuple[int, dict[str, Any]]], num_layers: int = 1) -> FuzzReport:
    """Each drawn pair: refused by `validate_for` on both sides before any process starts
    (examples.pd_disagg.check_layouts), or run (P world exports, D world imports and
    decodes) and checked against one device; raises on the first mismatch."""
    rows = []
    counts = {"ran": 0, "refused": 0}
    t_all = time.perf_counter()
    for seed, pins in draws:
        draw_ = draw_pd(seed, num_layers, pins)
        case = draw_.case
        where = f"fuzz P/D pair seed={seed} ({CP_FUZZ_RERUN}{seed}): {case}"
        t0 = time.perf_counter()
        bad = pd_check_layouts(case)
        if bad:
            counts["refused"] += 1
            rows.append((draw_, f"refused ({bad[:200]})", time.perf_counter() - t0, set()))
            continue
        p_out, d_out, models = pd_run_cases([case], timeout=600.0)
        for out, who in ((p_out, "prefill"), (d_out, "decode")):
            if isinstance(out, BaseException):
                raise AssertionError(f"the {who} world failed: {out}\n{where}") from out
        ref = pd_reference(case, *models[0])
        res = pd_compare(case, ref, [o[0] for o in p_out], [o[0] for o in d_out], pd_geometry_of(*models[0]))
        assert res["equal"], f"D's greedy tokens {[o[0]['tokens'] for o in d_out]} != one device's " \
                             f"{ref['tokens']}: {where}"
        assert res["max_logit_diff"] < 1e-4, f"max |logit diff| {res['max_logit_diff']:.2e}: {where}"
        assert res["bytes"] == res["formula"], f"D read {res['bytes']} B, the formula says {res['formula']}: {where}"
        assert set(res["verdicts"].values()) == {"ok"}, f"P's verdicts {res['verdicts']}: {where}"
        counts["ran"] += 1
        axes = {"P/D layout pair"} if case.p != case.d else set()
        rows.append((draw_, "ran", time.perf_counter() - t0, axes))
    report = FuzzReport(counts, rows, time.perf_counter() - t_all)
    print(f"\nconfig fuzz (P/D pairs): {len(draws)} pairs, {counts['ran']} ran and matched one device, "
          f"{counts['refused']} refused before any process started; {report.secs:.0f} s\n" + "\n".join(report.table()))
    return report


CP_FUZZ_RERUN = "rerun: CP_FUZZ_SEEDS="
# The default draw: (seed, pins) per world. The pins make the cases cover
# REQUIRED_AXES between them (which the test checks from what ran); every unpinned axis
# and the schedule come from the seed. Eager lowering keeps the compiles cheap; one case
# keeps aot_eager so both lowerings stay in the default run.
DEFAULT_DRAW: dict[int, list[tuple[int, dict[str, Any]]]] = {
    2: [
        # MLA DCP with query replication and verify steps (k = 2); the issue-35 case.
        (501, dict(kind="mla", tp=2, dcp=2, merge="replicate", interleave=1, spec_k=2, lowering="eager")),
        # GQA DCP, all-to-all merge, interleave = block size.
        (502, dict(kind="gqa", num_kv_heads=1, tp=2, dcp=2, merge="a2a", interleave="block", block=4, spec_k=0,
                   lowering="aot_eager")),
        # SFA DCP (dcp == tp, replicated indexer), AG+RS merge.
        (503, dict(kind="sfa", tp=2, dcp=2, merge="ag_rs", dsa_cp=False, interleave=1, spec_k=0,
                   lowering="eager")),
        # DSA-CP (prefill graphs token-sharded over TP; it is built for dcp = pcp = 1).
        (505, dict(kind="sfa", tp=2, dcp=1, dsa_cp=True, spec_k=0, lowering="eager")),
    ],
    4: [
        # PCP with DCP (tp 2, dcp 2, pcp 2), verify steps (k = 3) in PCP's decode layout.
        (504, dict(kind="gqa", num_kv_heads=1, tp=2, dcp=2, merge="ag_rs", interleave="block", spec_k=3,
                   lowering="eager")),
    ],
}


# The default draw's P/D pair: P at (tp 2, dcp 1) exports to D at (tp 2, dcp 2) with
# interleave 1: D's CP ranks each read every other token of P's whole blocks (the
# default pairs of test_pd_disagg.py are P pcp 2 -> D dcp 1 and, MLA, P dcp 1 -> D dcp 2
# with interleave = block size). P at dcp 1 runs uncompiled, which keeps the pair cheap.
# The kind, block sizes, P's interleave and the prompts come from the seed.
DEFAULT_PD: list[tuple[int, dict[str, Any]]] = [
    (506, dict(p_tp=2, p_dcp=1, d_dcp=2, d_interleave=1)),
]


def _seeds(default: list[int]) -> list[int]:
    env = os.environ.get("CP_FUZZ_SEEDS")
    return [int(s) for s in env.split(",")] if env else default


def _default_draw(world: int) -> list[tuple[int, dict[str, Any]]]:
    """DEFAULT_DRAW[world]; under CP_FUZZ_SEEDS the listed seeds instead: a default
    seed with its pins on its own world, any other seed unpinned on 2 ranks (but
    DEFAULT_PD's seeds, which `_default_pd` runs)."""
    if not os.environ.get("CP_FUZZ_SEEDS"):
        return DEFAULT_DRAW[world]
    home = {s: (w, p) for w, draws in DEFAULT_DRAW.items() for s, p in draws}
    pd = {s for s, _ in DEFAULT_PD}  # P/D pairs: `_default_pd`
    return [(s, home.get(s, (2, {}))[1]) for s in _seeds([]) if home.get(s, (2, {}))[0] == world and s not in pd]


def _default_pd() -> list[tuple[int, dict[str, Any]]]:
    """DEFAULT_PD; under CP_FUZZ_SEEDS only its seeds that are listed."""
    if not os.environ.get("CP_FUZZ_SEEDS"):
        return DEFAULT_PD
    return [(s, p) for s, p in DEFAULT_PD if s in _seeds([])]


def test_config_fuzz_default(summary_note: Callable[[str], None]) -> None:
    reports = [fuzz(draws, world, num_layers=1) for world in sorted(DEFAULT_DRAW) if (draws := _default_draw(world))]
    if pd := _default_pd():
        reports.append(fuzz_pd(pd, num_layers=1))
    summary_note(f"config fuzz default draw: {sum(r.secs for r in reports):.0f} s "
                 f"(worlds {', '.join(f'{len(r.rows)} cases {r.secs:.0f} s' for r in reports)}); rank 0 per case "
                 "(P/D: the pair's wall time):")
    for r in reports:
        for line in r.case_lines():
            summary_note(line)
    summary_note("  coverage (axis <- cases that ran, matched one device and whose passes rewrote for it):")
    uncovered = []
    for axis in REQUIRED_AXES:
        seeds = [s for r in reports for s in r.coverage()[axis]]
        summary_note(f"    {axis:<20} <- {', '.join(f'seed {s}' for s in seeds) or 'NOT COVERED'}")
        uncovered += [] if seeds else [axis]
    if not os.environ.get("CP_FUZZ_SEEDS"):
        assert not uncovered, f"default draw leaves {uncovered} uncovered"


def test_fuzz_catches_mla_context_lens(summary_note: Callable[[str], None]) -> None:
    """The fuzz's power on issue 35's bug: with MLA DCP attending context lengths
    instead of causal lengths (mutated in the spawned ranks), the default MLA DCP case
    must fail the comparison with one device."""
    seed, pins = DEFAULT_DRAW[2][0]
    assert pins["kind"] == "mla"
    t0 = time.perf_counter()
    with pytest.raises(AssertionError) as failed:
        # No verify steps: the first (prefill) step already shows the bug, and the
        # verify graph would add a compile.
        fuzz([(seed, {**pins, "spec_k": 0})], 2, num_layers=1, mutation="mla_context_lens")
    # The comparison with one device failed, not something else on the way.
    message = str(failed.value)
    assert f"seed={seed}" in message and ("not close" in message or "greedy tokens" in message), message
    summary_note(f"config fuzz, MLA context-lens mutation: caught ({time.perf_counter() - t0:.0f} s): "
                 f"{str(failed.value).splitlines()[0][:160]}")


@pytest.mark.slow
def test_config_fuzz_wide():
    fuzz(_seeds(list(range(100, 140))), 2)
    fuzz(_seeds(list(range(200, 216))), 4)
    fuzz_pd([(s, {}) for s in _seeds(list(range(300, 306)))], num_layers=2)
