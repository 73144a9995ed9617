"""Unmodified Hugging Face causal LMs under DCP.

    import cp_compile, cp_compile.serving.hf
    cfg = cp_compile.CPConfig(tensor_parallel_size=2, decode_context_parallel_size=2, block_size=16)
    cp_compile.init_parallel(cfg)                       # torchrun world (tp = dcp = 1 needs none)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    engine = cp_compile.serving.hf.Engine(model, cfg, num_blocks=1024)
    tokens = engine.generate(prompts, max_new_tokens=64)

`transformers` is imported here only (plain `import cp_compile` does not). Pieces:
`support` (what is served, what is refused by name), `attention` (the functions
registered with `transformers.AttentionInterface`), `cache` (`PagedCache`, handed to
the model as `cache=`), `tp` (the head-sharding TP plan), `engine` (`Engine`).
"""

from cp_compile.serving.hf.attention import GQA_NAME, MLA_NAME, register
from cp_compile.serving.hf.cache import PagedCache
from cp_compile.serving.hf.engine import Engine, kv_cache_spec
from cp_compile.serving.hf.support import SUPPORTED, UnsupportedModelError, attention_spec, check_supported
from cp_compile.serving.hf.tp import shard_model

__all__ = ["Engine", "PagedCache", "SUPPORTED", "UnsupportedModelError", "attention_spec", "check_supported",
           "kv_cache_spec", "register", "shard_model", "GQA_NAME", "MLA_NAME"]
