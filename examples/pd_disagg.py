"""PD disaggregation: a prefill instance and a decode instance of different CP layouts.

Two separate process worlds on CPU ranks (gloo), each with its own
`init_parallel`: the prefill (P) instance prefills the prompts and exports their KV
(`kv_transfer_config={"kv_role": "kv_producer", ...}`); the decode (D) instance
imports it over NIXL (UCX, DRAM here) into its own blocks, each D rank reading only
the tokens and KV heads it owns from the P ranks that hold them, then decodes. The
same prompts run on one device; the script prints both token streams and exits
non-zero if they differ.

    python -m examples.pd_disagg --p-tp 2 --p-dcp 2 --d-tp 2 --d-dcp 1
    python -m examples.pd_disagg --p-tp 1 --p-pcp 2 --d-tp 2 --d-dcp 2 --model mla
    python -m examples.pd_disagg --p-tp 2 --p-dcp 2 --p-interleave 4 --d-tp 2 --d-dcp 1 --d-block-size 8 --model sfa

Run as a module from the repository root (the spawned ranks import it by name).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

import cp_compile
from cp_compile.serving.kv_transfer import ImportedRequest, KVGeometry, KVLayout, expected_bytes
from cp_compile.testing.two_worlds import run_two_worlds
from examples.serving import (import_and_decode, layer_caches, make_kv_role, prefill_and_export,
                              release_exported)

NUM_BLOCKS = 24


@dataclass(frozen=True)
class Side:
    tp: int = 1
    pcp: int = 1
    dcp: int = 1
    interleave: int = 1
    block_size: int = 4
    kv_cache_dtype: str = "auto"  # "int8" / "fp8_e4m3": a quantised cache, its scales moved with the pages

    def config(self) -> cp_compile.CPConfig:
        return cp_compile.CPConfig(tensor_parallel_size=self.tp, prefill_context_parallel_size=self.pcp,
                                   decode_context_parallel_size=self.dcp, cp_kv_cache_interleave_size=self.interleave,
                                   block_size=self.block_size, kv_cache_dtype=self.kv_cache_dtype)

    def describe(self) -> str:
        s = f"tp{self.tp}" + (f",pcp{self.pcp}" if self.pcp > 1 else "") + f",dcp{self.dcp}"
        s += f",I{self.interleave},bs{self.block_size}"
        return s + (f",{self.kv_cache_dtype}" if self.kv_cache_dtype != "auto" else "")


@dataclass(frozen=True)
class Case:
    kind: str  # "gqa" | "mla" | "sfa"
    p: Side
    d: Side
    num_kv_heads: int = 1
    prompt_lens: tuple[int, ...] = (13, 6)
    steps: int = 4
    fault: str = ""  # "", "mismatch" (D serves another model), "ownership" (D drops the request mid-transfer),
    # "kill" (P rank 1 dies mid-transfer), "stall" (P rank 1 stays alive but never reports request 0 ready),
    # "dtype" (the sides' kv_cache_dtype differ: refused like "mismatch", same model)
    timeout_s: float = 30.0
    num_layers: int = 2  # the fuzz's P/D pair runs 1 layer (tests/fuzz/test_config_fuzz.py)

    def name(self) -> str:
        return f"{self.kind} P({self.p.describe()}) -> D({self.d.describe()})" + (f" [{self.fault}]" if self.fault else "")


def hf_model(kind: str, num_kv_heads: int = 1, num_layers: int = 2):
    from examples.models.tiny import hf_deepseek_sfa, hf_deepseek_v3, hf_qwen3

    if kind == "gqa":
        return hf_qwen3(num_kv_heads=num_kv_heads, num_heads=4, num_layers=num_layers)
    if kind == "mla":
        return hf_deepseek_v3(q_lora_rank=None, num_heads=4, num_layers=num_layers)
    return hf_deepseek_sfa(num_heads=4, num_layers=num_layers)


def prompts_of(case: Case, vocab: int) -> dict[int, list[int]]:
    g = torch.Generator().manual_seed(sum(case.prompt_lens))
    return {r: torch.randint(0, vocab, (n,), generator=g).tolist() for r, n in enumerate(case.prompt_lens)}


def kv_config(case_index: int, role: str, store_port: int, timeout_s: float) -> dict:
    engine = f"prefill-{case_index}"
    cfg = {"kv_role": role, "kv_connector": "NixlConnector", "kv_ip": "127.0.0.1", "kv_port": store_port,
           "engine_id": engine if role == "kv_producer" else f"decode-{case_index}",
           "kv_connector_extra_config": {"transfer_timeout_s": timeout_s}}
    if role == "kv_consumer":
        cfg["kv_connector_extra_config"]["remote_engine_id"] = engine
    return cfg


def _instance(side: Side, hf_config, state_dict, kind: str):
    """init_parallel, the TP-sharded example model (compiled with cp_ascend when the
    cache is sharded), this rank's cache and allocator."""
    from examples.models.tiny import example_from_config

    cfg = side.config()
    state = cp_compile.init_parallel(cfg, device="cpu")
    model = example_from_config(hf_config, state_dict, side.tp, state.layout.tp.rank, state.tp_group)
    cache = cp_compile.allocate_kv_cache(cfg, model.kv_cache_spec(), NUM_BLOCKS, attention=model.attention_spec())
    forward = model
    if cfg.context_parallel_size > 1:
        forward = cp_compile.compile_model(model, lowering="eager",
                                           indexer="self_attn.indexer" if kind == "sfa" else None)
    return cfg, state, model, cache, forward, cp_compile.BlockAllocator(NUM_BLOCKS, cfg.virtual_block_size)


def prefill_world(rank: int, world: int, store_port: int, cases: list[Case], models: list[tuple],
                  save_dir: str | None = None) -> list[dict]:
    """The P instance: each case's prompts prefilled and exported, then released. With
    `save_dir`, the results so far are saved after each case (`p<rank>.pt`): a case that
    kills a P rank (fault "kill", last) loses the world's return value, not the others'."""
    outs = []
    for i, (case, (hf_config, sd)) in enumerate(zip(cases, models)):
        cfg, state, model, cache, forward, alloc = _instance(case.p, hf_config, sd, case.kind)
        producer = make_kv_role(kv_config(i, "kv_producer", store_port, case.timeout_s), cfg, cache, model, rank,
                                alloc)
        producer.exchange.store.set(f"test/{i}/pid/{rank}", str(os.getpid()))
        prompts = prompts_of(case, hf_config.vocab_size)
        exporter = _StalledOnFirst(producer) if case.fault == "stall" and rank == 1 else producer
        last = prefill_and_export(forward, layer_caches(cache), alloc, prompts, exporter)
        verdicts = release_exported(producer, alloc, sorted(prompts))
        outs.append(dict(last=last, verdicts=verdicts, free=alloc.num_free))
        if save_dir is not None:
            torch.save(outs, os.path.join(save_dir, f"p{rank}.pt"))
        cp_compile.destroy_parallel()
        torch._dynamo.reset()
    return outs


class _StalledOnFirst:
    """Fault injection (tests): a producer rank that prefilled request 0 but never
    reports it ready (hung after its forward, alive); later requests as usual."""

    def __init__(self, producer: Any) -> None:
        self.producer = producer

    def export(self, req_id: int, *args: Any) -> None:
        if req_id != 0:
            self.producer.export(req_id, *args)


def _kill_prefill_rank(store, case_index: int, rank: int) -> None:
    """Fault injection (tests): SIGKILL producer rank `rank` and wait until it is gone."""
    pid = int(store.get(f"test/{case_index}/pid/{rank}"))
    os.kill(pid, signal.SIGKILL)
    while True:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(") ", 1)[1].startswith(("Z", "X")):
                    return
        except FileNotFoundError:
            return
        time.sleep(0.01)


def _nonzero(t: torch.Tensor) -> int:
    """Nonzero elements of a cache tensor (fp8 pages: counted on their bytes, torch has no fp8 count_nonzero)."""
    if t.dtype == torch.float8_e4m3fn:
        return int(t.view(torch.uint8).count_nonzero())
    return int(t.count_nonzero())


def decode_world(rank: int, world: int, store_port: int, cases: list[Case], models: list[tuple]) -> list[dict]:
    """The D instance: each case's requests imported, then decoded (or the fault's outcome)."""
    outs = []
    for i, (case, (hf_config, sd)) in enumerate(zip(cases, models)):
        cfg, state, model, cache, forward, alloc = _instance(case.d, hf_config, sd, case.kind)
        consumer = make_kv_role(kv_config(i, "kv_consumer", store_port, case.timeout_s), cfg, cache, model, rank,
                                alloc)
        rids = list(range(len(case.prompt_lens)))
        out: dict[str, Any] = dict(rank=rank)
        if case.fault:
            out.update(_decode_fault(case, i, consumer, alloc, rids))
            if case.fault == "stall":  # request 0 failed; what it left, then the next request is served
                out["cache_nonzero_after_fault"] = [_nonzero(t) for layer in layer_caches(cache)
                                                    for t in layer]
                out["free_after_fault"] = alloc.num_free
                tokens, steps, imported = import_and_decode(forward, layer_caches(cache), alloc, consumer, rids[1:],
                                                            case.steps)
                out.update(tokens=tokens, steps=steps, imported=imported)
        else:
            tokens, steps, imported = import_and_decode(forward, layer_caches(cache), alloc, consumer, rids,
                                                        case.steps)
            out.update(tokens=tokens, steps=steps, imported=imported)
        out["cache_nonzero"] = [_nonzero(t) for layer in layer_caches(cache) for t in layer]
        out["layer_nonzero"] = [sum(_nonzero(t) for t in layer) for layer in layer_caches(cache)]
        out["free"], out["num_blocks"] = alloc.num_free, NUM_BLOCKS
        outs.append(out)
        cp_compile.destroy_parallel()
        torch._dynamo.reset()
    return outs


def _decode_fault(case: Case, i: int, consumer, alloc, rids: list[int]) -> dict:
    from cp_compile.serving.kv_transfer import KVOwnershipError, KVTransferError

    if case.fault == "stall":  # time the verdict from P rank 0's report (P's prefill is not the bound)
        consumer.exchange.store.wait([consumer.exchange._key("req", rids[0], "ready", 0)])
    t0 = time.monotonic()
    on_layer = None
    if case.fault == "kill":
        def on_layer(layer: int) -> None:
            if layer == 0:  # every D rank has layer 0, then P rank 1 dies, then layer 1 is read
                torch.distributed.barrier()
                if consumer.rank == 0:
                    _kill_prefill_rank(consumer.exchange.store, i, 1)
                torch.distributed.barrier()
    elif case.fault == "ownership":
        def on_layer(layer: int) -> None:
            if layer == 0:  # the request is dropped and its blocks go to another one mid-transfer
                alloc.free(rids[0])
                alloc.ensure(99, case.prompt_lens[0])
    try:
        consumer.import_request(rids[0], on_layer=on_layer)
        return dict(error=None, seconds=time.monotonic() - t0)
    except (KVTransferError, cp_compile.ConfigError) as exc:
        alloc.free(99)
        return dict(error=f"{type(exc).__name__}: {exc}", ownership=isinstance(exc, KVOwnershipError),
                    seconds=time.monotonic() - t0)


class SameInstanceHandoff:
    """The single-device run's producer and consumer at once: the KV stays where the
    prefill wrote it (the reference the PD run is compared with)."""

    def __init__(self) -> None:
        self.ready: dict[int, tuple[int, int]] = {}

    def export(self, req_id: int, num_tokens: int, block_table: list[int], first_token: int) -> None:
        self.ready[req_id] = (num_tokens, first_token)

    def import_request(self, req_id: int) -> ImportedRequest:
        n, first = self.ready[req_id]
        return ImportedRequest(req_id, n, first, 0, 0.0, ())


def reference(case: Case, hf_config, state_dict) -> dict:
    from examples.models.tiny import example_from_config

    model = example_from_config(hf_config, state_dict)
    cfg = cp_compile.CPConfig(block_size=8, kv_cache_dtype=case.p.kv_cache_dtype)  # the same quantised cache
    cache = cp_compile.allocate_kv_cache(cfg, model.kv_cache_spec(), NUM_BLOCKS, attention=model.attention_spec())
    alloc = cp_compile.BlockAllocator(NUM_BLOCKS, cfg.virtual_block_size)
    handoff = SameInstanceHandoff()
    prompts = prompts_of(case, hf_config.vocab_size)
    last = prefill_and_export(model, layer_caches(cache), alloc, prompts, handoff)
    tokens, steps, _ = import_and_decode(model, layer_caches(cache), alloc, handoff, sorted(prompts), case.steps)
    return dict(last=last, tokens=tokens, steps=steps)


def geometry_of(hf_config, state_dict, kv_cache_dtype: str = "auto") -> KVGeometry:
    from cp_compile.base.config import KV_CACHE_DTYPES
    from examples.models.tiny import example_from_config

    model = example_from_config(hf_config, state_dict)
    return KVGeometry.of(model.kv_cache_spec(), model.attention_spec(),
                         KV_CACHE_DTYPES[kv_cache_dtype] or torch.float32, kv_cache_dtype,
                         index_dtype=torch.float32)  # the example models' dtype (SFA's indexer keys)


def compare(case: Case, ref: dict, p_out: list[dict], d_out: list[dict], geometry: KVGeometry) -> dict:
    """Tokens equal on every D rank, logit differences, bytes vs the formula."""
    diff = max(float((p["last"][r] - ref["last"][r]).abs().max()) for p in p_out for r in ref["last"])
    equal = True
    moved = 0
    for d in d_out:
        equal &= d["tokens"] == ref["tokens"]
        for got, want in zip(d["steps"], ref["steps"]):
            diff = max(diff, float((got - want).abs().max()))
        moved += sum(imp.bytes_moved for imp in d["imported"].values())
    formula = sum(expected_bytes(geometry, KVLayout.from_config(case.d.config()), n) for n in case.prompt_lens)
    seconds = max(imp.seconds for d in d_out for imp in d["imported"].values())
    return dict(equal=bool(equal), max_logit_diff=diff, bytes=moved, formula=formula, seconds=seconds,
                verdicts=p_out[0]["verdicts"])


def run_cases(cases: list[Case], timeout: float = 600.0, save_dir: str | None = None
              ) -> tuple[list, list, list[tuple]]:
    """Both worlds over `cases` (same P and D world sizes); returns (P results, D results,
    models). `save_dir`: see `prefill_world` (a "kill" case must be the last)."""
    assert all(c.fault != "kill" for c in cases[:-1]), "a case that kills a P rank must be the last"
    hfs = [hf_model(c.kind, c.num_kv_heads, c.num_layers) for c in cases]
    models = [(h.config, {k: v.detach().clone() for k, v in h.state_dict().items()}) for h in hfs]
    p_world, d_world = cases[0].p.tp * cases[0].p.pcp, cases[0].d.tp * cases[0].d.pcp
    assert all(c.p.tp * c.p.pcp == p_world and c.d.tp * c.d.pcp == d_world for c in cases)
    d_models = [_decode_model(c, m) for c, m in zip(cases, models)]
    p, d = run_two_worlds(prefill_world, p_world, (cases, models, save_dir), decode_world, d_world, (cases, d_models),
                          timeout=timeout, peer_grace=3.0)
    return p, d, models


def _decode_model(case: Case, model: tuple) -> tuple:
    """The model the D instance serves: the same one, except under the "mismatch" fault
    (one more layer: a different model, refused before any byte moves)."""
    if case.fault != "mismatch":
        return model
    h = hf_model(case.kind, case.num_kv_heads, num_layers=case.num_layers + 1)
    return h.config, {k: v.detach().clone() for k, v in h.state_dict().items()}


def check_layouts(case: Case) -> str:
    """Both layouts against the model's attention, before any process starts ("" if fine)."""
    from examples.models.tiny import example_from_config

    h = hf_model(case.kind, case.num_kv_heads, case.num_layers)
    attention = example_from_config(h.config, h.state_dict()).attention_spec()
    for who, side in (("prefill", case.p), ("decode", case.d)):
        try:
            side.config().validate_for(attention)
        except cp_compile.ConfigError as exc:
            return f"the {who} layout {side.describe()} is refused: {exc}"
    return ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for side in ("p", "d"):
        ap.add_argument(f"--{side}-tp", type=int, default=2)
        ap.add_argument(f"--{side}-dcp", type=int, default=1)
        ap.add_argument(f"--{side}-interleave", type=int, default=1)
        ap.add_argument(f"--{side}-block-size", type=int, default=4)
    ap.add_argument("--p-pcp", type=int, default=1)
    ap.add_argument("--model", choices=("gqa", "mla", "sfa"), default="gqa")
    ap.add_argument("--kv-heads", type=int, default=1, help="GQA KV heads")
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[13, 6])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--kv-cache-dtype", choices=("auto", "int8", "fp8_e4m3"), default="auto",
                    help="both instances' CPConfig.kv_cache_dtype (the single device's too)")
    ap.add_argument("--fault", choices=("mismatch", "ownership", "kill", "stall"), default="",
                    help="inject a fault (the tests' cases): the run must then fail, with the D ranks' errors")
    a = ap.parse_args(argv)
    case = Case(a.model, Side(a.p_tp, a.p_pcp, a.p_dcp, a.p_interleave, a.p_block_size, a.kv_cache_dtype),
                Side(a.d_tp, 1, a.d_dcp, a.d_interleave, a.d_block_size, a.kv_cache_dtype), num_kv_heads=a.kv_heads,
                prompt_lens=tuple(a.prompt_lens), steps=a.steps, fault=a.fault,
                timeout_s=3.0 if a.fault == "stall" else 30.0)
    bad = check_layouts(case)
    if bad:
        print(f"pd_disagg: {bad}", file=sys.stderr)
        return 2
    print(f"case: {case.name()}  (P world {case.p.tp * case.p.pcp} ranks, D world {case.d.tp} ranks, "
          f"separate process groups, NIXL UCX over DRAM)")
    t0 = time.time()
    p_out, d_out, models = run_cases([case])
    for out, who in ((p_out, "prefill"), (d_out, "decode")):
        if isinstance(out, BaseException) and not (case.fault == "kill" and who == "prefill"):
            print(f"pd_disagg: the {who} instance failed: {out}", file=sys.stderr)
            return 1
    if case.fault:
        for o in d_out:
            print(f"pd_disagg: D rank {o[0]['rank']}: request 0 failed after {o[0]['seconds']:.2f} s: "
                  f"{o[0]['error']}", file=sys.stderr)
        return 1
    ref = reference(case, *models[0])
    p_ranks, d_ranks = [o[0] for o in p_out], [o[0] for o in d_out]
    res = compare(case, ref, p_ranks, d_ranks, geometry_of(*models[0], case.p.kv_cache_dtype))
    for r in sorted(ref["tokens"]):
        print(f"request {r} ({case.prompt_lens[r]} prompt tokens)")
        print(f"  single device : {ref['tokens'][r]}")
        for d in d_ranks:
            imp = d["imported"][r]
            print(f"  PD, D rank {d['rank']}  : {d['tokens'][r]}   (read {imp.bytes_moved} B from P ranks "
                  f"{list(imp.src_ranks)} in {imp.seconds * 1e3:.1f} ms)")
    print(f"max |logit diff| {res['max_logit_diff']:.2e}; bytes moved {res['bytes']} (formula {res['formula']}); "
          f"consumer verdicts {res['verdicts']}; {time.time() - t0:.1f} s")
    ok = res["equal"] and res["bytes"] == res["formula"]
    print("tokens equal: " + ("yes" if res["equal"] else "NO") + "; bytes == formula: "
          + ("yes" if res["bytes"] == res["formula"] else "NO"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
