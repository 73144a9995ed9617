"""What a fixed KV budget per rank buys at dcp 1 and dcp 2 (start-up capacity report).

    python -m examples.kv_capacity                         # tiny random Qwen3, tp 2, 48 KiB per rank
    python -m examples.kv_capacity --model /path/to/ckpt --kv-cache-memory-bytes 8589934592 --max-model-len 32768
    python -m examples.kv_capacity --kv-cache-dtype int8   # quantised pages: the report splits pages + scales

Starts `cp_compile.LLM` at the same world (tp 2) and the same `kv_cache_memory_bytes`
per rank, once with dcp 1 and once with dcp 2; each start prints its KV pool (rank 0):
blocks and bytes, tokens per rank, tokens per DCP group, and the maximum concurrency at
`max_model_len` (a quantised cache, `--kv-cache-dtype`: the block's page and fp32 scale
bytes apart, both in the block and so in the capacity; issue 39). Then it serves `--requests` prompts of `max_model_len` tokens (prompt
+ max_tokens) through continuous batching and prints the wall time (one run: a
capacity report, not a benchmark).
"""

from __future__ import annotations

import argparse
import tempfile
import time

from cp_compile import LLM, SamplingParams


def tiny_checkpoint() -> str:
    from examples.models.tiny import hf_qwen3

    path = tempfile.mkdtemp(prefix="kv-capacity-qwen3-")
    model = hf_qwen3(num_kv_heads=1)  # tp 2 > 1 KV head: dcp 2 shards the replicated head's tokens
    model.generation_config.eos_token_id = None
    model.save_pretrained(path)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint directory (default: a tiny random Qwen3)")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--kv-cache-memory-bytes", type=int, default=48 * 1024)
    ap.add_argument("--max-model-len", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=4)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--lowering", default="eager", choices=("auto", "inductor", "aot_eager", "eager"))
    ap.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8_e4m3", "int8"))
    args = ap.parse_args()
    path = args.model or tiny_checkpoint()
    out_tokens = 8
    prompt = list(range(3, 3 + args.max_model_len - out_tokens))
    for dcp in (1, 2):
        print(f"--- tp {args.tp}, dcp {dcp}, kv_cache_memory_bytes {args.kv_cache_memory_bytes:,d} per rank, "
              f"kv_cache_dtype {args.kv_cache_dtype}", flush=True)
        with LLM(path, tensor_parallel_size=args.tp, decode_context_parallel_size=dcp, block_size=args.block_size,
                 max_model_len=args.max_model_len, max_num_seqs=64, lowering=args.lowering,
                 kv_cache_memory_bytes=args.kv_cache_memory_bytes, kv_cache_dtype=args.kv_cache_dtype) as llm:
            t0 = time.perf_counter()
            outs = llm.generate([prompt] * args.requests, SamplingParams(temperature=0, max_tokens=out_tokens,
                                                                          ignore_eos=True))
            wall = time.perf_counter() - t0
        print(f"served {len(outs)} requests of {args.max_model_len} tokens in {wall:.1f} s", flush=True)


if __name__ == "__main__":
    main()
