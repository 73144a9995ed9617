"""The seeds' models through `cp_compile.serving.hf.Engine` against HF's own greedy `generate`.

    python -m examples.seed_parity --model deepseek_v2_lite --tp 2 --dcp 2 --pcp 2   # 4 spawned CPU ranks

One rank function (`serve_rank`) shared by the tests and this script: it loads the
checkpoint directory with `from_pretrained` (the saved safetensors, no model code of
ours), serves the prompts with continuous batching (the third request joins at step
3, a prefill beside decodes) and returns tokens, per-token logits, graph count and
KV figures. `compare` checks them against `hf_reference` (examples.hf_generate).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from typing import Any

import torch

import cp_compile
import cp_compile.serving.hf

BLOCK, NUM_BLOCKS = 4, 16
MAX_NEW = [8, 5, 8]
ARRIVALS = [0, 0, 3]


def prompts(vocab: int, lens: tuple[int, ...] = (7, 3, 5), seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]  # ids 0-2 are special


def serve_rank(rank: int, world: int, path: str, prompt_ids: list[list[int]], max_new: list[int], tp: int, dcp: int,
               pcp: int, interleave: int, lowering: str, dsa_cp: bool = False) -> dict[str, Any]:
    import transformers

    cfg = cp_compile.CPConfig(tensor_parallel_size=tp, decode_context_parallel_size=dcp,
                              prefill_context_parallel_size=pcp, cp_kv_cache_interleave_size=interleave,
                              block_size=BLOCK, enable_dsa_cp=dsa_cp)
    if world > 1 or dcp > 1:
        cp_compile.init_parallel(cfg, device="cpu")
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = cp_compile.serving.hf.Engine(model, cfg, num_blocks=NUM_BLOCKS, lowering=lowering, forbid_recompiles=True,
                                  record_logits=True, eos_token_id=None)
    tokens = engine.generate(prompt_ids, max_new_tokens=max_new, arrivals=ARRIVALS[:len(prompt_ids)])
    return dict(tokens=tokens, logits=[torch.stack(engine.last_logits[i]) for i in range(len(prompt_ids))],
                graphs=engine.num_graphs, steps=engine.steps, capacity=engine.capacity())


def hf_reference(path: str, prompt_ids: list[list[int]], max_new_tokens: int) -> tuple[list[list[int]], list[torch.Tensor]]:
    import transformers

    from examples.hf_generate import hf_reference as ref

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return ref(model, prompt_ids, max_new_tokens)


def compare(outs: list[dict[str, Any]], ref_tokens: list[list[int]], ref_logits: list[torch.Tensor],
            max_new: list[int]) -> dict[str, Any]:
    """Max logit diff over ranks and requests, tokens equal on every rank, graphs."""
    worst, equal = 0.0, True
    for out in outs:
        for i, n in enumerate(max_new):
            equal &= out["tokens"][i] == ref_tokens[i][:n]
            worst = max(worst, (out["logits"][i] - ref_logits[i][:n]).abs().max().item())
    return dict(tokens_equal=equal, max_logit_diff=worst, graphs=max(o["graphs"] for o in outs),
                steps=outs[0]["steps"], capacity=outs[0]["capacity"])


def run(kind: str, tp: int, dcp: int, pcp: int, interleave: int = 1, lowering: str = "aot_eager",
        dsa_cp: bool = False, path: str | None = None) -> dict[str, Any]:
    from cp_compile.testing.multirank import run_on_ranks
    from examples.models.tiny_seed import save_checkpoint, tiny_seed_model

    with tempfile.TemporaryDirectory() as tmp:
        path = path or save_checkpoint(tiny_seed_model(kind), tmp, tokenizer=False)
        ids = prompts(128)  # examples.models.tiny.VOCAB
        t0 = time.time()
        world = tp * pcp
        args = (path, ids, MAX_NEW, tp, dcp, pcp, interleave, lowering, dsa_cp)
        outs = [serve_rank(0, 1, *args)] if world == 1 and dcp == 1 else run_on_ranks(serve_rank, world, *args,
                                                                                      timeout=900)
        wall = time.time() - t0
        ref_tokens, ref_logits = hf_reference(path, ids, max(MAX_NEW))
    res = compare(outs, ref_tokens, ref_logits, MAX_NEW)
    res.update(kind=kind, tp=tp, dcp=dcp, pcp=pcp, interleave=interleave, dsa_cp=dsa_cp, lowering=lowering,
               wall_s=wall)
    return res


def row(res: dict[str, Any]) -> str:
    cap = res["capacity"]
    return (f"| {res['kind']} | {res['tp']} | {res['dcp']} | {res['pcp']} | {res['dsa_cp']} | {res['lowering']} | "
            f"{'yes' if res['tokens_equal'] else 'NO'} | {res['max_logit_diff']:.1e} | {res['graphs']} | "
            f"{cap['kv_bytes_per_rank']:,d} | {cap['kv_bytes_per_rank_dcp1']:,d} | {res['wall_s']:.0f} s |")


HEADER = ("| model | tp | dcp | pcp | dsa_cp | lowering | tokens equal HF | max logit diff | graphs | KV B/rank | "
          "same tokens at dcp=pcp=1 | wall |\n|---|---|---|---|---|---|---|---|---|---|---|---|")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="deepseek_v2_lite")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--dcp", type=int, default=2)
    ap.add_argument("--pcp", type=int, default=1)
    ap.add_argument("--interleave", type=int, default=1)
    ap.add_argument("--dsa-cp", action="store_true")
    ap.add_argument("--lowering", default="aot_eager", choices=("eager", "aot_eager", "inductor"))
    a = ap.parse_args()
    print(HEADER)
    print(row(run(a.model, a.tp, a.dcp, a.pcp, a.interleave, a.lowering, a.dsa_cp)))


if __name__ == "__main__":
    main()
