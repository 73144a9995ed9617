"""Step compiled_step: an example model's decode step compiled with cp_ascend, captured and replayed.

The Qwen3-style example model (examples/models/qwen3.py; random weights, 2 layers,
16 query / 2 KV heads of 128, bf16) compiled with `cp_compile.backend(...)` (Inductor on
the GPU; aot_eager in the rehearsal, where an Inductor CPU compile costs minutes),
fullgraph, static shapes, the per-call step validation off (`validate_steps = False`:
its host reads cannot be captured). One world-of-one (dcp = 1: one GPU cannot host
two NCCL ranks of one communicator; the DCP math is the dcp_emulation step). On CUDA
the compiled call is captured in a CUDA graph; between replays the metadata is
mutated in place (positions and seq_lens + 1, the new slots, a block-table entry
moved to a spare page, new input ids) and each replay's logits are compared with
the uncompiled model run eagerly on the same inputs.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from tools.devcheck.common import Ctx, max_err, tol, within

DEVICE = dict(hidden=1024, layers=2, heads=16, kv_heads=2, D=128, inter=2048, vocab=4096, lens=[4096, 1, 777, 2000],
              block=64, replays=3, dtype=torch.bfloat16, lowering="inductor")
REHEARSE = dict(hidden=64, layers=1, heads=4, kv_heads=2, D=16, inter=64, vocab=128, lens=[9, 1, 5], block=4,
                replays=2, dtype=torch.float32, lowering="aot_eager")


def run(ctx: Ctx) -> Iterator[dict[str, Any]]:
    import cp_compile
    from cp_compile.runtime.metadata import AttentionMetadata
    from examples.models.qwen3 import Qwen3Config, Qwen3Model

    s = REHEARSE if ctx.rehearse else DEVICE
    dev, dt = ctx.device, s["dtype"]
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=s["vocab"], hidden_size=s["hidden"], num_layers=s["layers"], num_heads=s["heads"],
                      num_kv_heads=s["kv_heads"], head_dim=s["D"], intermediate_size=s["inter"])
    model = Qwen3Model(cfg).to(device=dev, dtype=dt).eval()
    for prm in model.parameters():  # default inits leave some weights zero / one: random, small
        prm.data.copy_(torch.randn_like(prm) * 0.05)
    B, bs, lens = len(s["lens"]), s["block"], s["lens"]
    width = -(-(max(lens) + s["replays"] + 1) // bs)
    nblocks = B * width + B
    kv = [(torch.randn(nblocks, bs, s["kv_heads"], s["D"], device=dev).to(dt) * 0.5,
           torch.randn(nblocks, bs, s["kv_heads"], s["D"], device=dev).to(dt) * 0.5) for _ in range(s["layers"])]
    seq = torch.tensor(lens, dtype=torch.int32, device=dev)
    bt = torch.randperm(B * width, device=dev).view(B, width).to(torch.int32)
    meta = AttentionMetadata(query_start_loc=torch.arange(B + 1, dtype=torch.int32, device=dev), seq_lens=seq,
                             block_table=bt, slot_mapping=torch.empty(B, dtype=torch.long, device=dev),
                             positions=torch.empty(B, dtype=torch.long, device=dev))
    ids = torch.empty(B, dtype=torch.long, device=dev)

    def refresh() -> None:
        pos = seq.long() - 1
        meta.positions.copy_(pos)
        meta.slot_mapping.copy_(bt.long()[torch.arange(B, device=dev), pos // bs] * bs + pos % bs)
        ids.copy_(torch.randint(0, s["vocab"], (B,), device=dev))

    refresh()
    backend = cp_compile.backend(lowering=s["lowering"])
    backend.validate_steps = False
    compiled = torch.compile(model.forward, backend=backend, fullgraph=True, dynamic=False)
    with torch.no_grad():
        first = compiled(ids, meta.positions, kv, meta)  # compiles
        graph = None
        if ctx.cuda:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                compiled(ids, meta.positions, kv, meta)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static = compiled(ids, meta.positions, kv, meta)
        for replay in range(s["replays"]):
            if replay:
                seq.add_(1)
                j = (int(seq[0]) - 1) // bs
                bt[0, j] = B * width + replay
                refresh()
            if graph is not None:
                graph.replay()
                torch.cuda.synchronize()
                got = static.clone()
            else:
                got = first if replay == 0 else compiled(ids, meta.positions, kv, meta)
            want = type(model).forward(model, ids, meta.positions, kv, meta)  # eager, uncompiled
            err = max_err(got, want)
            row = {"model": f"Qwen3-style {s['layers']} layers, {s['heads']}/{s['kv_heads']} heads x {s['D']}",
                   "lowering": s["lowering"], "replay": replay, "seq_lens": seq.tolist(), "captured": graph is not None,
                   "logits_vs_eager": err, "tol": tol(dt, dev), "ok": within(err, dt, dev)}
            if graph is None:
                row["graph"] = "skipped: rehearsal on CPU (no CUDA graphs); each call runs the compiled forward"
            yield row
