"""The GE graph of the example DeepSeek MLA model with the `mla_preprocess` pass off and on.

    TORCH_DEVICE_BACKEND_AUTOLOAD=0 .venv-torchair/bin/python -m tools.mla_preprocess_ge_count

torchair's real FX -> GE conversion with only its C++ extension stood in (as
`tools.ge_check`): the example DeepSeek MLA model at the tiny DeepSeek-V3
shape (2 layers, q-LoRA, bf16), one device, one step. Prints the GE op count
of each graph, the FX nodes torchair converted, and the op types whose counts differ.
"""

from __future__ import annotations

import json
import sys

import torch


def main() -> int:
    from tools import torchair_standin as standin

    standin.install()
    import cp_compile
    from cp_compile.ops.core.ge_registry import register_converters
    from tools.ge_check.reading import FxRecorder, compile_and_load
    from examples.models.deepseek_mla import DeepseekMLAConfig, DeepseekMLAModel

    from tools.ge_eval import probe

    register_converters()
    probe.install()  # the GE graph is run on CPU by tools.ge_eval and compared with the FX graph by value
    recorder = FxRecorder()
    # The tiny DeepSeek-V3 shape of examples/models/tiny.py (no transformers in this environment).
    mcfg = DeepseekMLAConfig(vocab_size=128, hidden_size=64, num_layers=2, num_heads=4, q_lora_rank=24,
                             kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                             intermediate_size=128)
    out = {}
    for on in (False, True):
        torch._dynamo.reset()
        cfg = cp_compile.CPConfig(block_size=4, enable_mla_preprocess=on)
        torch.manual_seed(0)
        model = DeepseekMLAModel(mcfg).eval().to(torch.bfloat16)
        cache = cp_compile.allocate_kv_cache(cfg, model.kv_cache_spec(), 16, dtype=torch.bfloat16, scratch_block=True)
        compiled = cp_compile.compile_model(model, lowering="torchair", torchair_mode="max-autotune", config=cfg)
        meta = cp_compile.build_attention_metadata([(0, 5), (0, 3)], cp_compile.BlockAllocator(16, 4),
                                                   num_padding_tokens=2, max_blocks_per_req=4)

        def step():
            with torch.no_grad():
                compiled(torch.zeros(10, dtype=torch.long), meta.positions, cache.layers, meta)

        r = compile_and_load(step, f"mla enable_mla_preprocess={on}", recorder)
        if r.status != "ok":
            print(f"{r.name}: {r.status}: {r.message!r}", file=sys.stderr)
            return 1
        out[on] = dict(ge_ops=sum(r.ge_ops.values()), fx_nodes=r.fx_nodes, by_type=r.ge_ops,
                       values_ok=all(v["ok"] for v in r.values), compared=len(r.values))
    diff = {t: (out[False]["by_type"].get(t, 0), out[True]["by_type"].get(t, 0))
            for t in sorted(set(out[False]["by_type"]) | set(out[True]["by_type"]))
            if out[False]["by_type"].get(t, 0) != out[True]["by_type"].get(t, 0)}
    print(f"GE graph, example MLA (2 layers): off {out[False]['ge_ops']} GE ops from {out[False]['fx_nodes']} FX nodes; "
          f"on {out[True]['ge_ops']} GE ops from {out[True]['fx_nodes']} FX nodes")
    print("op types that differ (off, on):", json.dumps(diff))
    print("GE == FX by value:", {("on" if k else "off"): (v["values_ok"], v["compared"]) for k, v in out.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
