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

    model: str  # "qwen3" | "mla" | "sfa": the kind (for presets, the preset's)
    tp: int
    dcp: tuple[int, ...]
    context: tuple[int, ...]
    batch: tuple[int, ...]
    interleave: int
    block_size: int
    steps: int
    warmup: int
    lowering: str
    merge: tuple[str, ...]  # DCP merges to compare (one world per (dcp > 1, merge))
    out: str
    dtype: str
    shape: str = "tiny"
    profile_steps: int = 3  # profiled steps per config after the timed ones (0: no breakdown)
    compile_probe: bool = True  # compile time of cp_ascend vs the plain lowering, per DCP world
    kv_budget_gib: float = 16.0  # KV bytes per rank for the largest-context figure
    repeat: int = 1  # passes over the worlds, every other one in reverse order (ABBA)
    spec_tokens: int = 0  # > 0: speculative decoding on vs off per DCP world (examples/bench/spec.py)
    proposer: str = "none"  # the proposer of --spec-tokens (examples/spec.py PROPOSERS)

    @property
    def ranks(self) -> int:
        """Ranks per world (the world size)."""
        return self.tp

    @property
    def worlds(self) -> tuple[tuple[int, str], ...]:
        """(dcp, merge) per world; each world with dcp > 1 also times the dcp = 1 baseline."""
        worlds = tuple((d, m) for d in self.dcp if d > 1 for m in self.merge)
        return worlds or ((1, "none"),)

    @property
    def schedule(self) -> tuple[tuple[int, str], ...]:
        """Worlds in run order over `repeat` passes: forward, reversed, forward, ..."""
        return tuple(w for r in range(self.repeat) for w in (self.worlds if r % 2 == 0 else self.worlds[::-1]))

    @property
    def decode_steps(self) -> int:
        """Steps per config that advance the context: warm-up, timed and profiled."""
        return self.warmup + self.steps + self.profile_steps

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


@dataclass(frozen=True)
class PrefillArgs(BenchArgs):
    """The prefill benchmark's options: `context` is unused; each step prefills `prompt` tokens."""

    prompt: tuple[int, ...] = (1024,)  # prompt lengths (tokens per request)
    prefix: int = 0  # cached prefix of the chunked-prefill variant (0: whole-prompt steps only)
    dsa_cp: bool = False  # one world: DSA-CP off vs on at dcp = 1 (examples/bench/dsa_cp.py)
    pcp: int = 1  # > 1: one world of tp * pcp ranks, PCP vs its pcp = 1 baseline (examples/bench/pcp.py)

    @property
    def ranks(self) -> int:
        return self.tp * self.pcp

    @property
    def worlds(self) -> tuple[tuple[int, str], ...]:
        if self.dsa_cp:
            return ((1, "dsa_cp"),)
        if self.pcp > 1:
            return ((1, "pcp"),)
        return super().worlds

    def chunks(self, prompt: int) -> tuple[int, ...]:
        """Cached-prefix lengths measured at `prompt`: 0 (whole prompt in one step), and `prefix`
        when it leaves a chunk to run."""
        return (0, self.prefix) if 0 < self.prefix < prompt else (0,)


def int_list(text: str) -> tuple[int, ...]:
    """argparse type: comma-separated positive integers."""
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from e
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def merge_list(text: str) -> tuple[str, ...]:
    values = tuple(dict.fromkeys(v.strip() for v in text.split(",") if v.strip()))
    bad = [v for v in values if v not in ("ag_rs", "a2a", "replicate", "auto")]
    if not values or bad:
        raise argparse.ArgumentTypeError(f"expected a comma list of ag_rs, a2a, replicate, auto, got {text!r}")
    return values


def build_parser(description: str, bench: str = "decode") -> argparse.ArgumentParser:
    """Options of `bench` ("decode" or "prefill"); the shared ones are the same for both."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    from examples.bench.shapes import PRESETS, SHAPES

    p.add_argument("--shape", choices=SHAPES, default="tiny",
                   help="tiny (CI) or a preset with a real deployment's per-rank attention "
                        "(examples/bench/shapes.py): " + ", ".join(f"{k} ({v.source})" for k, v in PRESETS.items()))
    p.add_argument("--model", choices=("qwen3", "mla", "sfa"), default=None,
                   help="tiny shape: tiny Qwen3 (GQA, 1 KV head), DeepSeek MLA (no q_lora) or DeepSeek-V3.2 SFA "
                        "[qwen3]; presets fix the kind")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size = world size")
    p.add_argument("--dcp", type=int_list, default=(1, 2),
                   help="DCP sizes to compare; 1 (the TP baseline) is always included")
    if bench == "decode":
        p.add_argument("--context", type=int_list, default=(256, 1024, 4096), help="cached context lengths")
    else:
        p.add_argument("--prompt", type=int_list, default=(1024, 4096), help="prompt lengths (tokens per request)")
        p.add_argument("--prefix", type=int, default=0,
                       help="chunked-prefill variant: this many prompt tokens are already cached (filled "
                            "directly) and the step runs the rest; 0: whole-prompt steps only")
        p.add_argument("--dsa-cp", action="store_true",
                       help="SFA only: time DSA-CP on vs off (plain TP) side by side in one world at dcp = 1 "
                            "instead of the DCP worlds")
        p.add_argument("--pcp", type=int, default=1,
                       help="> 1: one world of tp * pcp ranks timing PCP (prefill tokens split over pcp groups) "
                            "vs its pcp = 1 baseline at the same tp, side by side, instead of the DCP worlds")
    p.add_argument("--batch", type=int_list, default=(1, 4) if bench == "decode" else (1,),
                   help="requests per step")
    p.add_argument("--interleave", type=int, default=1, help="cp_kv_cache_interleave_size")
    p.add_argument("--block-size", type=int, default=16, help="per-rank KV page size (tokens)")
    p.add_argument("--steps", type=int, default=5 if bench == "decode" else 3, help="timed steps per config")
    p.add_argument("--warmup", type=int, default=2 if bench == "decode" else 1, help="untimed steps per config")
    p.add_argument("--lowering", choices=("inductor", "aot_eager"), default="inductor")
    p.add_argument("--merge", type=merge_list, default=("ag_rs",),
                   help="DCP LSE merges to compare side by side: ag_rs, a2a, replicate, auto (the cost model "
                        "chooses per graph; the row's merge_decision says what and why), e.g. ag_rs,a2a,auto")
    p.add_argument("--out", default=f"results/bench_{bench}", help="output directory")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    p.add_argument("--profile-steps", type=int, default=3 if bench == "decode" else 1,
                   help="profiled steps per config after the timed ones: per-step time breakdown "
                        "(attention, DCP/TP collectives, rest); 0 turns it off")
    if bench == "decode":
        p.add_argument("--compile-probe", action=argparse.BooleanOptionalAction, default=True,
                       help="per DCP world, time a fresh compile with cp_ascend vs the plain lowering")
    p.add_argument("--repeat", type=int, default=1,
                   help="passes over the worlds, every other pass in reverse order, so that a slow spell of a "
                        "shared machine hits dcp = 1 and dcp = N alike; steps of all passes are pooled")
    if bench == "decode":
        p.add_argument("--spec-tokens", type=int, default=0,
                       help="> 0: speculative decoding with this many draft tokens per request, on vs off side by "
                            "side in each DCP world (acceptance, tokens per step, TPOT; --shape tiny)")
        p.add_argument("--proposer", choices=("mtp", "draft", "layer_skip"), default=None,
                       help="--spec-tokens proposer: mtp (MLA / SFA, default), draft (GQA, default) or "
                            "layer_skip (GQA: the target's first layer and head)")
        p.add_argument("--kv-budget-gib", type=float, default=16.0,
                       help="KV bytes per rank for the largest context that fits (real layer count of the shape)")
    return p


def _shared_fields(p: argparse.ArgumentParser, a: argparse.Namespace) -> dict[str, object]:
    """Checks and fields common to decode and prefill (argparse errors exit like any bad flag)."""
    if a.steps < 1 or a.warmup < 0 or a.profile_steps < 0:
        p.error("--steps must be >= 1, --warmup and --profile-steps >= 0")
    if a.repeat < 1:
        p.error("--repeat must be >= 1")
    from examples.bench.shapes import PRESETS

    model = a.model or "qwen3"
    if a.shape != "tiny":
        if a.model is not None and a.model != PRESETS[a.shape].kind:
            p.error(f"--shape {a.shape} is a {PRESETS[a.shape].kind} model; drop --model {a.model}")
        model = PRESETS[a.shape].kind
    dcp = tuple(sorted(set(a.dcp) | {1}))
    bad = [d for d in dcp if a.tp % d]
    if bad:
        p.error(f"--dcp {bad} must divide --tp {a.tp}")
    if model == "sfa" and any(d not in (1, a.tp) for d in dcp):
        p.error(f"SFA DCP (replicated indexer) runs at dcp == tp: use --dcp {a.tp}")
    return dict(model=model, tp=a.tp, dcp=dcp, batch=tuple(sorted(set(a.batch))), interleave=a.interleave,
                block_size=a.block_size, steps=a.steps, warmup=a.warmup, lowering=a.lowering, merge=a.merge,
                out=a.out, dtype=a.dtype, shape=a.shape, profile_steps=a.profile_steps, repeat=a.repeat)


def parse_args(argv: Sequence[str] | None = None, description: str = "") -> BenchArgs:
    p = build_parser(description)
    a = p.parse_args(argv)
    if a.kv_budget_gib <= 0:
        p.error("--kv-budget-gib must be > 0")
    shared = _shared_fields(p, a)
    proposer = "none"
    if a.spec_tokens < 0:
        p.error(f"--spec-tokens must be >= 0, got {a.spec_tokens}")
    if a.spec_tokens > 0:
        if a.shape != "tiny":
            p.error("--spec-tokens runs on --shape tiny (the proposers load the target's HF-named weights)")
        proposer = a.proposer or ("draft" if shared["model"] == "qwen3" else "mtp")
        if (proposer == "mtp") == (shared["model"] == "qwen3"):
            p.error(f"--proposer {proposer} does not fit --model {shared['model']}: mtp for mla / sfa, "
                    f"draft or layer_skip for qwen3")
    elif a.proposer is not None:
        p.error("--proposer needs --spec-tokens k (k > 0)")
    return BenchArgs(**shared, context=tuple(sorted(set(a.context))),  # type: ignore[arg-type]
                     compile_probe=a.compile_probe, kv_budget_gib=a.kv_budget_gib, spec_tokens=a.spec_tokens,
                     proposer=proposer)


def parse_prefill_args(argv: Sequence[str] | None = None, description: str = "") -> PrefillArgs:
    p = build_parser(description, bench="prefill")
    a = p.parse_args(argv)
    if a.prefix < 0:
        p.error("--prefix must be >= 0")
    prompt = tuple(sorted(set(a.prompt)))
    if a.prefix and a.prefix >= max(prompt):
        p.error(f"--prefix {a.prefix} leaves no chunk to prefill: it must be < the longest --prompt {max(prompt)}")
    if a.pcp > 1:  # before the shared checks: the default --dcp 1,2 does not apply (nor need divide tp)
        if a.dcp != p.get_default("dcp") and max(a.dcp) > 1:
            p.error(f"--pcp is benchmarked at dcp = 1 (the CP collectives are then exactly the PCP ones): "
                    f"drop --dcp {','.join(map(str, a.dcp))}")
        a.dcp = (1,)
    fields = _shared_fields(p, a)
    if a.dsa_cp:
        if fields["model"] != "sfa":
            p.error(f"--dsa-cp needs a model with a lightning indexer: --model sfa or an sfa --shape, "
                    f"not {fields['model']}")
        if a.dcp != p.get_default("dcp") and max(a.dcp) > 1:
            p.error(f"--dsa-cp runs at dcp = 1 (DSA-CP with DCP is not built): drop --dcp {','.join(map(str, a.dcp))}")
        if a.tp < 2:
            p.error("--dsa-cp shards tokens over TP: --tp must be >= 2")
        fields["dcp"] = (1,)
    if a.pcp < 1:
        p.error(f"--pcp must be >= 1, got {a.pcp}")
    if a.pcp > 1:
        if a.dsa_cp:
            p.error("--pcp and --dsa-cp are separate benchmarks (DSA-CP with PCP is not built): drop one")
        if fields["model"] == "sfa":
            p.error("--pcp covers GQA and MLA (qwen3, mla shapes); SFA runs at pcp = 1: drop --pcp or pick "
                    "another --model / --shape")
        fields["dcp"] = (1,)
    # No compile probe: it times decode compiles, which bench_decode already reports.
    return PrefillArgs(**fields, context=(), compile_probe=False,  # type: ignore[arg-type]
                       prompt=prompt, prefix=a.prefix, dsa_cp=a.dsa_cp, pcp=a.pcp)
