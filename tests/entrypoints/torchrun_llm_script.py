"""Launched by torchrun from test_llm.py: the offline `LLM` as one rank of a torchrun
world (PCP 2), every rank running this script on the same requests (SPMD). Each rank
prints its tokens as one JSON line; the test compares them with the spawned path's."""

import json
import sys

from cp_compile import LLM, SamplingParams


def main(path: str, prompts: list[str]) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=8)
    sampled = SamplingParams(temperature=0.8, top_p=0.95, top_k=20, max_tokens=8, seed=5)
    llm = LLM(model=path, prefill_context_parallel_size=2, block_size=4, lowering="aot_eager", max_model_len=64)
    outs = llm.generate(prompts, [greedy, sampled, sampled], use_tqdm=False)
    import torch.distributed as dist

    rank = dist.get_rank()
    print("TOKENS " + json.dumps({"rank": rank, "tokens": [o.outputs[0].token_ids for o in outs],
                                  "capacity": llm.kv_capacity}), flush=True)
    llm.close()


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]))
