"""`python -m tools.ge_check`: arguments, the run, the table, the JSON and the exit
status (0 all converted and as expected, 1 something failed, 2 not runnable here)."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

import tools.ge_check as package
from tools import torchair_standin as standin
from tools.ge_check.converters import (CONVERTERS_ENV, folder_sources, load_converters, read_mutations,
                                       register_converters, run_mutations)
from tools.ge_check.model_graphs import BUILDING_RANKS, MODEL_WORLD, SFA_WORLD, expect_model, run_model_graphs
from tools.ge_check.op_graphs import ATEN_GE_OPS, base_op, expect_op, run_op_graphs
from tools.ge_check.reading import KEY_ATTRS, FxRecorder, GraphResult

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
    parser = argparse.ArgumentParser(description=package.__doc__.split("\n")[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--dump", help="write torchair's GE graph dumps (pbtxt) under this folder")
    parser.add_argument("--with-unconverted-op", action="store_true",
                        help="add an op that has no GE converter (the check must fail)")
    parser.add_argument("--ops-only", action="store_true", help="skip the model graphs (4 gloo ranks)")
    parser.add_argument("--op", action="append", help="only this op graph (e.g. cp::cache_write); implies --ops-only")
    parser.add_argument("--mutations", help="a JSON list of [name, converter module (dotted, or a file of the "
                        "repository), old text, new text, op] or [name, converter folder, op]: each op graph with "
                        "its converter code, in turn, every importer seeing that code (implies --ops-only)")
    parser.add_argument("--model", action="append", help="only this model graph, KIND:DCP:MERGE (e.g. sfa:2:ag_rs); "
                        "skips the op graphs")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        standin.install()
        from cp_compile.ops.core.ge_registry import GE_OPS
        from tools.ge_eval import probe

        folder = os.environ.get(CONVERTERS_ENV)
        if folder:
            load_converters(folder_sources(folder))
        register_converters()
        probe.install()
    except (RuntimeError, ImportError) as e:
        print(f"torchair GE check not runnable here: {e}", file=sys.stderr)
        return 2
    recorder = FxRecorder()
    not_applied: dict[str, str] = {}
    if args.mutations:
        rows, not_applied = read_mutations(args.mutations)
        for name, why in not_applied.items():
            print(f"mutation {name!r} not applied: {why}", file=sys.stderr)
        results = run_mutations(rows, recorder)
    else:
        results = [] if args.model else run_op_graphs(recorder, args.dump, args.with_unconverted_op, args.op)
    for r in results:
        case = r.name[3:]
        if r.status == "ok" and (base_op(case) in GE_OPS or case in ATEN_GE_OPS):
            problems = expect_op(r, case)
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
    # op_graphs: the cp ops with a graph; op_graph_variants: further cases of an op already
    # counted (e.g. `cp::paged_attention_lse[int8]`, the partial over a quantised cache).
    summary = dict(op_graphs=len({base_op(r.name) for r in results if r.name.startswith("op:cp::")}),
                   op_graph_variants=sum(r.name.startswith("op:cp::") and "[" in r.name for r in results),
                   aten_op_graphs=sum(r.name.startswith("op:aten::") for r in results),
                   model_graphs=sum(not r.name.startswith("op:") for r in results),
                   failed=len(failed), fx_nodes=sum(r.fx_nodes for r in results),
                   ge_ops=sum(sum(r.ge_ops.values()) for r in results),
                   hccl_ops=sum(len([g for g in r.groups]) for r in results),
                   cp_ops_defined=len(defined), cp_ops_without_converter=uncovered,
                   mutations_not_applied=not_applied, seconds=time.perf_counter() - start)
    print(table(results))
    print("\n" + values_table(results))
    print(f"\ntorchair GE check: {summary['op_graphs']} cp op graphs (+ {summary['op_graph_variants']} variants, "
          f"{summary['aten_op_graphs']} aten), "
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
    return 1 if failed or uncovered or not_applied else 0


