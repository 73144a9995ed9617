"""Benchmark options: one frozen dataclass, picklable, shipped to every rank."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Sequence

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class BenchArgs:
    """Everything a rank needs (picklable: shipped to spawned ranks)."""

    model: str
    tp: int
    dcp: tuple[int, ...]
    context: tuple[int, ...]
    batch: tuple[int, ...]
    interleave: int
    block_size: int
    steps: int
    warmup: int
    lowering: str
    merge: str
    out: str
    dtype: str

    @property
    def decode_steps(self) -> int:
        return self.warmup + self.steps

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


def int_list(text: str) -> tuple[int, ...]:
    """argparse type: comma-separated positive integers."""
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from e
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def build_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", choices=("qwen3", "mla"), default="qwen3",
                   help="tiny Qwen3 (GQA, 1 KV head) or DeepSeek MLA (no q_lora)")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size = world size")
    p.add_argument("--dcp", type=int_list, default=(1, 2),
                   help="DCP sizes to compare; 1 (the TP baseline) is always included")
    p.add_argument("--context", type=int_list, default=(256, 1024, 4096), help="cached context lengths")
    p.add_argument("--batch", type=int_list, default=(1, 4), help="decode batch sizes")
    p.add_argument("--interleave", type=int, default=1, help="cp_kv_cache_interleave_size")
    p.add_argument("--block-size", type=int, default=16, help="per-rank KV page size (tokens)")
    p.add_argument("--steps", type=int, default=5, help="timed decode steps per config")
    p.add_argument("--warmup", type=int, default=2, help="untimed decode steps per config")
    p.add_argument("--lowering", choices=("inductor", "aot_eager"), default="inductor")
    p.add_argument("--merge", choices=("ag_rs", "a2a"), default="ag_rs", help="DCP LSE merge")
    p.add_argument("--out", default="results/bench_decode", help="output directory")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    return p


def parse_args(argv: Sequence[str] | None = None, description: str = "") -> BenchArgs:
    p = build_parser(description)
    a = p.parse_args(argv)
    if a.steps < 1 or a.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    # The baseline goes first: its world also checks the model builds at this tp.
    dcp = tuple(sorted(set(a.dcp) | {1}))
    bad = [d for d in dcp if a.tp % d]
    if bad:
        p.error(f"--dcp {bad} must divide --tp {a.tp}")
    return BenchArgs(model=a.model, tp=a.tp, dcp=dcp, context=tuple(sorted(set(a.context))),
                     batch=tuple(sorted(set(a.batch))), interleave=a.interleave, block_size=a.block_size,
                     steps=a.steps, warmup=a.warmup, lowering=a.lowering, merge=a.merge, out=a.out,
                     dtype=a.dtype)
