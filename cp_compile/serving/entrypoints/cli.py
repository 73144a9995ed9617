"""`cp-compile serve <dir> ...`: the console script (pyproject `[project.scripts]`).

Flags use vLLM's names. The model id in `/v1/models` is the directory as given,
unless `--served-model-name` says otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys

from cp_compile.serving.entrypoints.llm import LLM
from cp_compile.serving.entrypoints.server import serve


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="cp-compile", description="cp-compile front ends")
    sub = ap.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server over a local checkpoint directory")
    s.add_argument("model", help="directory written by save_pretrained (config.json, *.safetensors, tokenizer)")
    s.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    s.add_argument("--decode-context-parallel-size", "-dcp", type=int, default=1)
    s.add_argument("--prefill-context-parallel-size", "-pcp", type=int, default=1)
    s.add_argument("--cp-kv-cache-interleave-size", type=int, default=1)
    s.add_argument("--block-size", type=int, default=16)
    s.add_argument("--dtype", default="auto", help="serving dtype (default: the checkpoint's torch_dtype)")
    s.add_argument("--max-model-len", type=int, default=None)
    s.add_argument("--max-num-seqs", type=int, default=8)
    s.add_argument("--num-kv-blocks", type=int, default=None, help="KV pages per rank (default: max-num-seqs "
                   "requests of max-model-len)")
    s.add_argument("--kv-cache-memory-bytes", type=int, default=None, help="KV pool bytes per rank (the pool's "
                   "blocks, tokens per rank / DCP group and max concurrency are printed at start-up)")
    s.add_argument("--kv-cache-dtype", default="auto", help="KV cache storage: auto (the model's dtype), fp8_e4m3 "
                   "or int8 (quantised pages + an fp32 scale per token and KV head; docs/quant_kv.md). vLLM's "
                   "'fp8' is spelled fp8_e4m3 here")
    s.add_argument("--enable-dsa-cp", action="store_true")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--lowering", default="auto", choices=("auto", "inductor", "aot_eager", "eager"))
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--served-model-name", default=None)
    s.add_argument("--step-timeout-s", type=float, default=300.0,
                   help="the most one engine step may take on the worker ranks (compile included) before the "
                   "server fails every request in flight, answers /health 503 and exits 1 (a hung worker)")
    s.add_argument("--kv-transfer-config", type=_json_dict, default=None,
                   help="PD disaggregation role as JSON (vLLM's keys), e.g. '{\"kv_role\": \"kv_producer\", "
                   "\"engine_id\": \"prefill-0\", \"kv_port\": 5600, \"kv_connector_extra_config\": "
                   "{\"store_master\": true}}'")
    return ap


def _json_dict(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON ({e}). Fix: quote the object, e.g. "
                                         "'{\"kv_role\": \"kv_consumer\", ...}'") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is a JSON {type(value).__name__}, not an object. Fix: "
                                         "'{\"kv_role\": ..., \"kv_port\": ...}'")
    return value


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    llm = LLM(model=args.model, tensor_parallel_size=args.tensor_parallel_size,
              decode_context_parallel_size=args.decode_context_parallel_size,
              prefill_context_parallel_size=args.prefill_context_parallel_size,
              cp_kv_cache_interleave_size=args.cp_kv_cache_interleave_size, block_size=args.block_size,
              dtype=args.dtype, max_model_len=args.max_model_len, enable_dsa_cp=args.enable_dsa_cp,
              max_num_seqs=args.max_num_seqs, num_kv_blocks=args.num_kv_blocks,
              kv_cache_memory_bytes=args.kv_cache_memory_bytes, kv_cache_dtype=args.kv_cache_dtype, seed=args.seed,
              lowering=args.lowering, kv_transfer_config=args.kv_transfer_config, step_timeout_s=args.step_timeout_s)
    print(f"cp-compile serve: {args.served_model_name or args.model} on http://{args.host}:{args.port} "
          f"(tp={args.tensor_parallel_size}, dcp={args.decode_context_parallel_size}, "
          f"pcp={args.prefill_context_parallel_size}"
          + (f", {args.kv_transfer_config['kv_role']}" if args.kv_transfer_config else "") + ")", file=sys.stderr, flush=True)
    # 1 when the engine failed (a worker died): the process manager restarts the server
    return serve(llm, args.served_model_name or args.model, host=args.host, port=args.port)


if __name__ == "__main__":
    sys.exit(main())
