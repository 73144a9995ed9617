"""Serve an unmodified tiny random HF model with DCP and compare with HF `generate`.

    python -m examples.hf_generate --model qwen3 --tp 2 --dcp 2      # spawns 2 CPU gloo ranks
    torchrun --nproc-per-node 2 -m examples.hf_generate --model llama  # same, under torchrun

Builds the model from a config (no hub), serves it with `cp_compile.serving.hf.Engine`
(the model's own HF modules, sharded in place by the head-sharding TP plan, the
attention routed to the paged cp ops, DCP-sharded KV cache), and prints the
generated tokens next to HF's own greedy `generate` on one device, plus the KV
capacity per rank against dcp = 1.
"""

from __future__ import annotations

import argparse
import copy
import os

import torch
import transformers

import cp_compile
import cp_compile.serving.hf
from examples.models.tiny import VOCAB, _randomize, hf_deepseek_v3, hf_qwen3

MODELS = ("qwen3", "qwen2", "llama", "mistral", "deepseek_v3")


def tiny_hf(kind: str, num_kv_heads: int = 1, num_layers: int = 2) -> transformers.PreTrainedModel:
    """A tiny random HF model (O(1) activations, eos disabled so runs have a fixed length)."""
    if kind == "qwen3":
        model = hf_qwen3(num_kv_heads=num_kv_heads, num_heads=4, num_layers=num_layers)
    elif kind == "deepseek_v3":
        model = hf_deepseek_v3(q_lora_rank=24, num_heads=4, num_layers=num_layers)
    elif kind in ("llama", "mistral", "qwen2"):
        common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                      num_attention_heads=4, num_key_value_heads=num_kv_heads, head_dim=16, rms_norm_eps=1e-6,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False,
                      attn_implementation="eager")
        if kind == "llama":
            cfg, cls = transformers.LlamaConfig(**common), transformers.LlamaForCausalLM
        elif kind == "qwen2":  # q/k/v biases: the TP plan shards them with their rows
            common.pop("head_dim")  # Qwen2 derives it: hidden / heads = 16
            cfg, cls = transformers.Qwen2Config(**common), transformers.Qwen2ForCausalLM
        else:
            cfg, cls = transformers.MistralConfig(sliding_window=None, **common), transformers.MistralForCausalLM
        torch.manual_seed(0)
        model = cls(cfg).eval()
        _randomize(model, 5)
    else:
        raise ValueError(f"--model {kind!r}: choose one of {MODELS}")
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def hf_reference(model: transformers.PreTrainedModel, prompts: list[list[int]], max_new_tokens: int
                 ) -> tuple[list[list[int]], list[torch.Tensor]]:
    """HF's own greedy generation on one device, one prompt at a time (no padding):
    tokens and the logits of each generated token [max_new_tokens, vocab]."""
    toks, logits = [], []
    for p in prompts:
        with torch.no_grad():
            out = model.generate(torch.tensor([p]), max_new_tokens=max_new_tokens, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True)
        toks.append(out.sequences[0, len(p):].tolist())
        logits.append(torch.cat(out.logits).float())
    return toks, logits


def serve(rank: int, world: int, hf_config, state_dict, prompts: list[list[int]], max_new_tokens: int,
          dcp: int, block_size: int, num_blocks: int, lowering: str, arrivals: list[int] | None = None,
          forbid_recompiles: bool = True, progress: bool = False, config_kw: dict | None = None) -> dict:
    """One rank: init_parallel, rebuild the HF model from its config, serve it (`config_kw`: more
    CPConfig fields, e.g. dcp_project_before_merge)."""
    cfg = cp_compile.CPConfig(tensor_parallel_size=world, decode_context_parallel_size=dcp, block_size=block_size,
                              **(config_kw or {}))
    if world > 1 or dcp > 1:
        cp_compile.init_parallel(cfg, device="cpu")
    # A copy: the engine points the config at its attention functions, and under torchrun the
    # caller's config also drives the HF reference.
    model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(hf_config)).eval()
    model.load_state_dict(state_dict)
    model.generation_config.eos_token_id = None
    engine = cp_compile.serving.hf.Engine(model, cfg, num_blocks=num_blocks, lowering=lowering,
                                  forbid_recompiles=forbid_recompiles, record_logits=True, progress=progress)
    tokens = engine.generate(prompts, max_new_tokens=max_new_tokens, arrivals=arrivals)
    return dict(tokens=tokens, logits=[torch.stack(engine.last_logits[i]) for i in range(len(prompts))],
                graphs=engine.num_graphs, steps=engine.steps, capacity=engine.capacity(), plan=engine.plan,
                history=[(h.name, h.rewrites) for h in engine.compiled.backend.pass_managers[0].history],
                decisions={h.name: h.decision for h in engine.compiled.backend.pass_managers[0].history})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=MODELS, default="qwen3")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--dcp", type=int, default=2)
    ap.add_argument("--kv-heads", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--lowering", default="aot_eager", choices=("aot_eager", "inductor", "eager"))
    args = ap.parse_args()
    hf = tiny_hf(args.model, num_kv_heads=args.kv_heads)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (7, 3, 5)]
    sd = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    run = (args.model, hf.config, sd, prompts, args.max_new_tokens, args.dcp, 4, 32, args.lowering)
    if "RANK" in os.environ:  # torchrun: this process is one rank
        import torch.distributed as dist

        dist.init_process_group("gloo")
        outs = [serve(dist.get_rank(), dist.get_world_size(), *run[1:])]
        world = dist.get_world_size()
        dist.destroy_process_group()
        if int(os.environ["RANK"]) != 0:
            return
    else:
        from cp_compile.testing.multirank import run_on_ranks

        outs = run_on_ranks(serve, args.tp, *run[1:], timeout=900)
    ref_tokens, ref_logits = hf_reference(hf, prompts, args.max_new_tokens)
    out = outs[0]
    print(f"{args.model}: tp={world if 'RANK' in os.environ else len(outs)} dcp={args.dcp} "
          f"({args.lowering}), {out['steps']} steps, {out['graphs']} compiled graph(s)")
    worst = 0.0
    for i, p in enumerate(prompts):
        worst = max(worst, (out["logits"][i] - ref_logits[i]).abs().max().item())
        same = out["tokens"][i] == ref_tokens[i]
        print(f"  prompt {i} ({len(p)} tokens)\n    cp_compile.serving.hf: {out['tokens'][i]}\n    HF generate  : "
              f"{ref_tokens[i]}  {'equal' if same else 'DIFFERENT'}")
    cap = out["capacity"]
    print(f"  max |logit diff| {worst:.2e}; KV per rank {cap['kv_bytes_per_rank']:,d} B for "
          f"{cap['tokens_per_group']} tokens ({cap['tokens_per_rank']} per rank); dcp=1 would hold "
          f"{cap['kv_bytes_per_rank_dcp1']:,d} B per rank")


if __name__ == "__main__":
    main()
