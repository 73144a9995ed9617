"""How many MLA layers of unmodified HF models the `mla_preprocess` pass rewrites (issue 27).

    PYTHONPATH=. .venv/bin/python -m tools.mla_preprocess_hf_matches [--models v2,v3-interleave,...]

Every tiny HF MLA model this transformers ships and `cp_compile.serving.hf` serves (DeepSeek-V2,
-V3, -V3.2, GLM-5; and two V2 variants the pass refuses, named with their reason),
through `cp_compile.serving.hf.Engine` (lowering eager: the passes run, the graph runs as FX)
with `enable_mla_preprocess` off, then on, recompiles forbidden after the warm-up.
Prints one markdown row per model: layers, layers rewritten, cache writes folded,
FX ops of the graph off -> on, greedy tokens equal, max |logit| difference, graphs
compiled per side, and the pass's warning (why a layer stayed unfused) if any.
`hf_engine_pair` is also what tests/passes/test_mla_preprocess_model.py runs.
"""

from __future__ import annotations

import argparse
import copy
import warnings
from typing import Any, Callable

import torch

BLOCK = 4
NUM_BLOCKS = 12
PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [6, 7, 8]]


def hf_engine_pair(hf_model: torch.nn.Module, cfg_kwargs: dict | None = None, lowering: str = "eager",
                   parallel: bool = False, max_new_tokens: int = 4,
                   engine_kwargs: dict | None = None) -> dict[bool, dict[str, Any]]:
    """Serve PROMPTS through cp_compile.serving.hf.Engine with enable_mla_preprocess off, then on
    (recompiles forbidden after the warm-up) -> per side: tokens, logits per prompt [n, vocab],
    pass history [(name, rewrites, ops before, ops after)], graphs compiled, the pass's warnings.
    `parallel`: this is one gloo rank; each side runs in its own init_parallel."""
    import cp_compile
    from cp_compile.serving.hf.engine import Engine

    out = {}
    for on in (False, True):
        torch._dynamo.reset()
        cfg = cp_compile.CPConfig(block_size=BLOCK, enable_mla_preprocess=on, **(cfg_kwargs or {}))
        if parallel:
            cp_compile.init_parallel(cfg, device="cpu")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                engine = Engine(copy.deepcopy(hf_model), cfg, num_blocks=NUM_BLOCKS, lowering=lowering,
                                progress=False, forbid_recompiles=True, record_logits=True,
                                **(engine_kwargs or {}))
                tokens = engine.generate(PROMPTS, max_new_tokens=max_new_tokens)
        finally:
            if parallel:
                cp_compile.destroy_parallel()
        for w in caught:  # hand them on (pytest.warns sees them), keep the pass's for the table
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        hist = [(h.name, h.rewrites, sum(h.before.values()), sum(h.after.values()))
                for b in engine.compiled.backends.values() for pm in b.pass_managers for h in pm.history]
        out[on] = dict(tokens=tokens, logits=[torch.stack(engine.last_logits[i]) for i in range(len(PROMPTS))],
                       hist=hist, graphs=engine.num_graphs,
                       warnings=[str(w.message) for w in caught if str(w.message).startswith("mla_preprocess")])
    return out


def rewrites(side: dict[str, Any], name: str) -> int:
    """The pass `name`'s rewrite count summed over the side's graphs."""
    return sum(n for pass_name, n, *_ in side["hist"] if pass_name == name)


def _models() -> dict[str, tuple[str, Callable[[], torch.nn.Module]]]:
    from examples.models.tiny import hf_deepseek_sfa, hf_deepseek_v2_lite, hf_deepseek_v3

    return {
        "v2": ("DeepSeek-V2-Lite (q_proj), complex RoPE", lambda: hf_deepseek_v2_lite()),
        "v2-q_lora": ("DeepSeek-V2 (q-LoRA), complex RoPE", lambda: hf_deepseek_v2_lite(q_lora_rank=24)),
        "v3-interleave": ("DeepSeek-V3 (q-LoRA), rope_interleave=True", lambda: hf_deepseek_v3(q_lora_rank=24)),
        "v3-q_proj": ("DeepSeek-V3 (q_proj), rope_interleave=True", lambda: hf_deepseek_v3(q_lora_rank=None)),
        "v3-rotate_half": ("DeepSeek-V3 (q-LoRA), rope_interleave=False",
                           lambda: hf_deepseek_v3(q_lora_rank=24, rope_interleave=False)),
        "v3.2": ("DeepSeek-V3.2 (deepseek_v32, hf/sfa.py)", lambda: hf_deepseek_sfa("deepseek_v32")),
        "glm-5": ("GLM-5 (glm_moe_dsa, hf/sfa.py)", lambda: hf_deepseek_sfa("glm_moe_dsa")),
        "v2-bf16": ("DeepSeek-V2-Lite, bf16", lambda: hf_deepseek_v2_lite().to(torch.bfloat16)),
        "v2-bias": ("DeepSeek-V2-Lite, attention_bias=True", lambda: hf_deepseek_v2_lite(attention_bias=True)),
    }


def _reason(text: str) -> str:
    """The first layer's reason from the pass's warning (after the node list)."""
    return text.split("): ", 1)[-1].split("] ", 1)[-1][:160]


def main() -> int:
    models = _models()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(models), help="comma-separated subset of " + ", ".join(models))
    args = ap.parse_args()
    print("| model | layers | rewritten | cache writes folded | FX ops off -> on | tokens equal | max abs dlogit "
          "| graphs off / on | unfused because |")
    print("|---|---|---|---|---|---|---|---|---|")
    for key in args.models.split(","):
        title, build = models[key]
        model = build()
        res = hf_engine_pair(model)
        off, on = res[False], res[True]
        dlogit = max((a.float() - b.float()).abs().max().item() for a, b in zip(on["logits"], off["logits"]))
        ops = next((f"{before} -> {after}" for name, _, before, after in on["hist"] if name == "mla_preprocess"), "-")
        folded = next((after for name, _, _, after in on["hist"] if name == "mla_preprocess_cache_write"), None)
        ops += f" -> {folded}" if folded is not None else ""
        why = _reason(on["warnings"][0]) if on["warnings"] else ""
        print(f"| {title} (`{key}`) | {model.config.num_hidden_layers} | {rewrites(on, 'mla_preprocess')} | "
              f"{rewrites(on, 'mla_preprocess_cache_write')} | {ops} | {on['tokens'] == off['tokens']} | "
              f"{dlogit:.1e} | {off['graphs']} / {on['graphs']} | {why} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
