"""The seed's offline example, run on a tiny random DeepSeek-V2-Lite-shaped checkpoint.

    python -m examples.seed_offline            # 4 spawned CPU gloo ranks: tp 2, dcp 2, pcp 2

Writes the checkpoint (MLA without q_lora, MoE with routed + shared experts, its own
tiny word-level tokenizer, all built offline: examples/models/tiny_seed.py) into a
temporary directory, then runs the seed's code with only the import changed
(`from cp_compile import ...` for `from vllm import ...`) and the model id pointing
at that directory. Prints the texts and the KV bytes each rank holds against what
it would hold at dcp = pcp = 1 for the same tokens.

The random weights make the text meaningless; what matters is that it runs as the
seed wrote it. CP_COMPILE_LOWERING defaults to aot_eager here: four Inductor
compiles on a small CPU take minutes (set it to inductor to compile for real).
"""

import os
import tempfile

from examples.models.tiny_seed import save_checkpoint, tiny_seed_model

os.environ.setdefault("CP_COMPILE_LOWERING", "aot_eager")
checkpoint = save_checkpoint(tiny_seed_model("deepseek_v2_lite"), tempfile.mkdtemp(prefix="tiny-DeepSeek-V2-Lite-"))

# ---- the seed's offline example (vLLM-Ascend context parallel guide) -------------
from cp_compile import LLM, SamplingParams  # was: from vllm import LLM, SamplingParams

prompts = [
    "The future of AI is",
]
sampling_params = SamplingParams(temperature=0.8, top_p=0.95)

llm = LLM(
    model=checkpoint,  # was: "deepseek-ai/DeepSeek-V2-Lite"
    tensor_parallel_size=2,
    decode_context_parallel_size=2,
    prefill_context_parallel_size=2,
)
outputs = llm.generate(prompts, sampling_params)
# ----------------------------------------------------------------------------------

for output in outputs:
    print(f"Prompt: {output.prompt!r}, Generated text: {output.outputs[0].text!r} "
          f"({len(output.outputs[0].token_ids)} tokens, finish_reason={output.outputs[0].finish_reason})")
print(f"world = tensor_parallel_size * prefill_context_parallel_size = {len(llm.kv_capacity)} ranks")
for rank, cap in enumerate(llm.kv_capacity):
    print(f"  rank {rank}: KV {cap['kv_bytes_per_rank']:,d} B for {cap['tokens_per_group']:,d} tokens "
          f"({cap['tokens_per_rank']:,d} stored here); at dcp = pcp = 1 the same tokens need "
          f"{cap['kv_bytes_per_rank_dcp1']:,d} B per rank ({cap['kv_bytes_per_rank_dcp1'] // cap['kv_bytes_per_rank']}x)")
llm.close()
