"""`Engine`: greedy generation with continuous batching for an unmodified HF model.

    engine = cp_compile.serving.hf.Engine(model, cfg, num_blocks=256)   # after init_parallel(cfg) when tp > 1
    out = engine.generate([[1, 2, 3], [4, 5]], max_new_tokens=32)   # token ids per prompt

Every step is one flattened batch (vLLM style): joining requests' prompts
(prefill) ride beside running requests' single tokens (decode), so prefill and
decode are one compiled graph. The token, request and block-table dims are
dynamic and never specialised on size 1 (`compile_model`'s one mechanism,
`decorator.no_size_specialisation`): a batch of one request reuses the graph.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch
from torch import nn

from cp_compile.base.config import ConfigError, CPConfig
from cp_compile.compiler.decorator import compile_model
from cp_compile.serving.hf.attention import GQA_NAME, MLA_NAME, register
from cp_compile.serving.hf.cache import PagedCache
from cp_compile.serving.hf.kv_scales import KVScales, attach
from cp_compile.serving.hf.moe import EXPERTS_IMPLEMENTATION, is_moe_block
from cp_compile.serving.loop.scheduler import Scheduler, StepPlan
from cp_compile.serving.hf.sfa import route_sfa_layers
from cp_compile.serving.loop.scheduler import Sequence as SchedSequence
from cp_compile.serving.loop.step_loop import RequestState, StepLoop
from cp_compile.serving.hf.support import attention_spec, check_supported, head_dim
from cp_compile.serving.hf.tp import shard_model
from cp_compile.runtime.kv_cache import KVCacheSpec, allocate_kv_cache, tp_kv_head_ids
from cp_compile.compiler.lowering import Lowering
from cp_compile.runtime.metadata_build import BlockAllocator, build_attention_metadata
from cp_compile.runtime.parallel_state import ParallelState, parallel_state_or_none
from cp_compile.base.sampling import SamplingParams, is_list_like, token_ids

def _sizes(cfg: CPConfig) -> tuple[int, int, int]:
    return (cfg.tensor_parallel_size, cfg.decode_context_parallel_size, cfg.prefill_context_parallel_size)


def _fmt(sizes: tuple[int, int, int]) -> str:
    return "tensor_parallel_size={}, decode_context_parallel_size={}, prefill_context_parallel_size={}".format(*sizes)


class _HFStep(nn.Module):
    """forward(input_ids[T], positions[T], kv_caches, meta) -> logits[T, vocab] over the HF model."""

    def __init__(self, hf_model: nn.Module) -> None:
        super().__init__()
        self.hf = hf_model
        self.cache = PagedCache()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[tuple[torch.Tensor, ...]],
                meta: Any) -> torch.Tensor:
        out = self.hf(input_ids=input_ids.unsqueeze(0), position_ids=positions.unsqueeze(0), cache=self.cache,
                      use_cache=True, cp_kv_caches=kv_caches, cp_meta=meta)
        return out.logits[0]  # [T, vocab]


def kv_cache_spec(config: Any, tp: int, tp_rank: int) -> KVCacheSpec:
    """This TP rank's per-layer cache geometry, from the HF config."""
    spec = attention_spec(config)
    if spec.kind in ("mla", "sfa"):
        return KVCacheSpec(num_layers=config.num_hidden_layers, kind=spec.kind,
                           latent_dim=config.kv_lora_rank + config.qk_rope_head_dim,
                           index_dim=config.index_head_dim if spec.kind == "sfa" else 0)
    ids = tp_kv_head_ids(spec.num_kv_heads, tp, tp_rank)
    d = head_dim(config)
    return KVCacheSpec(num_layers=config.num_hidden_layers, kind="gqa", head_dim=d, v_head_dim=d,
                       num_kv_heads_per_rank=len(ids), kv_head_ids=ids)


class Engine:
    """Serve an HF `*ForCausalLM` with DCP (see module doc).

    `config`: the `CPConfig` given to `cp_compile.init_parallel` (tp = dcp = 1 needs
    no parallel state). The model is sharded in place for this TP rank (a model
    `rank_load.load_rank_local` loaded is sharded already and kept as is).
    `num_blocks`: pages per layer on this rank (`config.block_size` tokens each); the
    group holds `num_blocks * block_size * dcp` tokens. `record_logits` keeps each
    generated token's logits (`Engine.last_logits`) for checks. `kv_scales`: a checkpoint's
    static per-layer KV scales (`kv_scales.read_kv_scales`), used with kv_cache_dtype
    "fp8_e4m3" (decision 71; `kv_scales_note` says what was done with them).
    """

    def __init__(self, model: nn.Module, config: CPConfig, num_blocks: int, *, max_batch: int = 16,
                 max_model_len: int | None = None, lowering: Lowering = "auto", warmup_steps: int = 2,
                 forbid_recompiles: bool = False, eos_token_id: int | None | str = "auto",
                 progress: bool | None = None, record_logits: bool = False,
                 parallel: ParallelState | None = None, kv_scales: dict[int, KVScales] | None = None) -> None:
        self.kind = check_supported(model.config)
        self.spec = attention_spec(model.config)
        config.validate_for(self.spec)
        if kv_scales and config.kv_cache_dtype == "fp8_e4m3" and config.prefill_context_parallel_size > 1:
            raise ConfigError("a checkpoint's static KV scales are served at prefill_context_parallel_size = 1",
                              f"prefill_context_parallel_size={config.prefill_context_parallel_size}, "
                              f"kv_cache_dtype='fp8_e4m3', k_scale / v_scale for {len(kv_scales)} layers (the PCP "
                              "prefill writes dynamic scales only; decision 71)",
                              "prefill_context_parallel_size=1 (dcp may be > 1), or kv_cache_dtype='int8' "
                              "(dynamic scales)")
        # The one read of the current state, at this front door (None: pass parallel=).
        state = self.parallel = parallel if parallel is not None else parallel_state_or_none()
        sizes = _sizes(config)
        if config.world_size * config.decode_context_parallel_size > 1 and state is None:
            raise ConfigError("init_parallel before Engine at tp, dcp or pcp > 1", _fmt(sizes),
                              "call cp_compile.init_parallel(config) on every rank first")
        if state is not None and _sizes(state.cfg) != sizes:
            raise ConfigError("Engine config == init_parallel config",
                              f"Engine {_fmt(sizes)}; init_parallel {_fmt(_sizes(state.cfg))}",
                              "pass the CPConfig given to init_parallel")
        self.config = config
        self.rank = state.rank if state is not None else 0
        tp_rank = state.layout.tp.rank if state is not None else 0
        if any(is_moe_block(layer.mlp) for layer in model.model.layers):
            # HF's default expert loop has data-dependent shapes (graph breaks, recompiles).
            model.config._experts_implementation = EXPERTS_IMPLEMENTATION
        self.plan = shard_model(model, config.tensor_parallel_size, tp_rank, state.tp_group if state is not None else None)
        register()
        # Before compiling: the attention functions read the layer's static scales off its module.
        self.kv_scales_note = attach(model, kv_scales or {}, self.kind, config.kv_cache_dtype)
        if self.kind == "sfa":
            route_sfa_layers(model)  # the layers' forward makes the indexer + sparse MLA op calls (sfa.py)
        model.config._attn_implementation = GQA_NAME if self.kind == "gqa" else MLA_NAME
        self.model = model.eval()
        first = next(model.parameters())
        dtype = first.dtype
        # Caches, metadata and inputs live where the model does (a CUDA / NPU model
        # gets device caches and one host-to-device copy of each step's metadata).
        self.device = first.device
        self.cache = allocate_kv_cache(config, kv_cache_spec(model.config, config.tensor_parallel_size, tp_rank), num_blocks,
                                       dtype=dtype, device=self.device, attention=self.spec, parallel=state)
        # Per layer: the sharded cache tensors, then SFA's replicated indexer cache.
        self.layer_caches = ([layer + (index,) for layer, index in zip(self.cache.layers, self.cache.replicated)]
                             if self.cache.replicated else self.cache.layers)
        self.num_blocks = num_blocks
        self.alloc = BlockAllocator(num_blocks, config.virtual_block_size)  # lives as long as the engine
        vbs = config.virtual_block_size
        cap = num_blocks * vbs
        self.max_model_len = min(max_model_len or cap, cap)
        self.block_table_width = math.ceil(self.max_model_len / vbs)
        self.max_batch = max_batch
        self.warmup_steps = warmup_steps
        self.forbid_recompiles = forbid_recompiles
        if eos_token_id == "auto":
            gen = getattr(model, "generation_config", None)
            eos_token_id = getattr(gen, "eos_token_id", None)
        self.eos = set(eos_token_id if isinstance(eos_token_id, (list, tuple)) else
                       ([] if eos_token_id is None else [eos_token_id]))
        self.progress = progress
        self.record_logits = record_logits
        self.step_module = _HFStep(model)
        self.compiled = compile_model(self.step_module, config=config, attention=self.spec, lowering=lowering,
                                      parallel=state)
        self.steps = 0
        self.peak_batch = 0  # most requests in one step so far (what the KV pool let run at once)
        self.last_logits: dict[int, list[torch.Tensor]] = {}  # prompt index -> [vocab] per generated token

    # ---- figures ------------------------------------------------------------------
    @property
    def num_graphs(self) -> int:
        """Graphs compiled so far: 1 after warm-up means no recompiles; 2 (decode, prefill)
        where the config compiles one graph per batch kind (DSA-CP), 3 under PCP once both
        a fresh prefill and one on cached context ran (docs/pcp.md §4)."""
        backends = list(self.compiled.backends.values()) or [self.compiled.backend]
        return sum(len(b.pass_managers) for b in backends)

    def capacity(self) -> dict[str, int]:
        """KV capacity: tokens this rank stores, tokens the DCP group serves, bytes on
        this rank, and what this rank would hold for the same tokens at dcp = 1."""
        bytes_rank = self.cache.sharded_bytes
        n = self.config.context_parallel_size  # pcp * dcp ranks share each token range
        return dict(tokens_per_rank=self.cache.tokens_per_rank, tokens_per_group=self.cache.tokens_per_rank * n,
                    kv_bytes_per_rank=bytes_rank, kv_bytes_per_rank_dcp1=bytes_rank * n,
                    kv_scale_bytes_per_rank=self.cache.scale_bytes,  # part of kv_bytes_per_rank (issue 39)
                    dcp=self.config.decode_context_parallel_size, pcp=self.config.prefill_context_parallel_size,
                    index_bytes_per_rank=self.cache.replicated_bytes,  # SFA's replicated indexer cache
                    gathered_weight_bytes_per_rank=self.gathered_weight_bytes())

    def gathered_weight_bytes(self) -> int:
        """Weights the compiled graphs gathered from the other DCP ranks and hold as buffers, on
        this rank: the all-reduce fold's o_proj columns and W_UV (decision 62), project before
        the merge's W_UV (decision 61); summed over the graphs compiled so far (each holds its
        own), 0 before the first step. `build_engine` takes the same bytes, computed from the config
        (serving/hf/gathered_weights.py), out of kv_cache_memory_bytes before sizing the pool."""
        keys = ("gathered_o_proj_bytes", "gathered_projection_bytes", "gathered_weight_bytes")
        return sum(int((h.decision or {}).get(k, 0)) for pm in self.compiled.backend.pass_managers
                   for h in pm.history for k in keys)

    # ---- serving ------------------------------------------------------------------
    def execute(self, plan: StepPlan) -> list[torch.Tensor]:
        """Run one step: free `plan.free`'s blocks (and roll back `plan.truncate`'s), then
        one forward over `plan.items`; returns each item's last-token logits [vocab]
        (fp32). Every rank runs the same plans in the same order (its allocator state is
        then the same everywhere)."""
        for rid in plan.free:
            self.alloc.free(rid)
        for rid, keep in plan.truncate:
            self.alloc.truncate(rid, keep)
        if not plan.items:
            return []
        # Each item's table before this step: a step that raises (metadata build, the
        # step's checks, the forward) gives back the blocks it took, so the allocator is
        # as it was. The forward may have written into them; nothing reads a position
        # before a step writes it, so those writes are never seen.
        before = {rid: len(self.alloc.blocks(rid)) for rid, _, _ in plan.items}
        try:
            input_ids, meta = self._inputs(plan.items)
            strict = self.forbid_recompiles and self.steps >= self.warmup_steps
            with torch.no_grad(), torch.compiler.set_stance("fail_on_recompile" if strict else "default"):
                logits = self.compiled(input_ids, meta.positions, self.layer_caches, meta)  # [T, vocab]
        except BaseException:
            self._undo_allocation(before)
            raise
        self.steps += 1
        self.peak_batch = max(self.peak_batch, len(plan.items))
        last = meta.query_start_loc[1:len(plan.items) + 1].long() - 1
        return list(logits[last].float())

    def _undo_allocation(self, before: dict[int, int]) -> None:
        """Shrink each request back to the blocks it held before a failed step (`before`:
        request id -> table length); a request that held none has no table left."""
        for rid, n in before.items():
            if n == 0:
                self.alloc.free(rid)
            else:
                self.alloc.truncate(rid, n * self.alloc.block_tokens)

    def _inputs(self, items: list[tuple[int, int, list[int]]]) -> tuple[torch.Tensor, Any]:
        """(input_ids [T], metadata) of one step, on the model's device."""
        reqs = [(cached, len(new)) for _, cached, new in items]
        rids = [rid for rid, _, _ in items]
        ids = [t for _, _, new in items for t in new]
        meta = build_attention_metadata(reqs, self.alloc, req_ids=rids, max_blocks_per_req=self.block_table_width,
                                        device=self.device)
        return torch.tensor(ids, dtype=torch.long, device=self.device), meta

    def scheduler(self) -> Scheduler:
        """A scheduler sized for this engine's cache."""
        return Scheduler(self.num_blocks, self.config.virtual_block_size, self.max_batch)

    def _check_generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int],
                        arrivals: Sequence[int] | None) -> tuple[list[list[int]], list[int], list[int]]:
        """`generate`'s arguments as plain ints, or ValueError naming the prompt (index,
        position, value) or the argument, and the fix; before anything is taken."""
        if not is_list_like(prompts):
            raise ValueError(f"prompts={prompts!r} is not a list of prompts. Fix: pass a list of token-id lists, "
                             "e.g. [[1, 2, 3]]")
        n = len(prompts)
        vocab = getattr(self.model.config, "vocab_size", None)
        ids = [token_ids(p, vocab, index=i) for i, p in enumerate(prompts)]  # RequestError is a ValueError

        def per_prompt(name: str, value: object, rule: str) -> list[int]:
            if not is_list_like(value):
                raise ValueError(f"{name}={value!r} must be a list with one value per prompt ({n}) or {rule}. Fix: "
                                 f"pass {n} values")
            if len(value) != n:
                raise ValueError(f"{name}: {len(value)} values for {n} prompts. Fix: give one per prompt ({n})")
            return list(value)

        if isinstance(max_new_tokens, (int, float, bool)) or max_new_tokens is None:
            max_new: list = [max_new_tokens] * n
        else:
            max_new = per_prompt("max_new_tokens", max_new_tokens, "one int for all")
        for i, m in enumerate(max_new):
            if isinstance(m, bool) or not isinstance(m, int) or m < 1:
                # HF generate refuses 0 too; one token would come back otherwise (issue 19).
                raise ValueError(f"prompt {i}: max_new_tokens={m!r} must be an integer >= 1. Fix: ask for at least "
                                 "one new token, as an int")
        if arrivals is None:
            arr = [0] * n
        else:
            arr = per_prompt("arrivals", arrivals, "None (all join at step 0)")
            for i, a in enumerate(arr):
                if isinstance(a, bool) or not isinstance(a, int) or a < 0:
                    raise ValueError(f"arrivals[{i}]={a!r} must be an integer step >= 0 (the step before which "
                                     f"prompt {i} may not join). Fix: e.g. 0")
        for i, (p, m) in enumerate(zip(ids, max_new)):
            if len(p) + m > self.max_model_len:
                raise ValueError(f"prompt {i}: {len(p)} tokens + max_new_tokens={m} > max_model_len="
                                 f"{self.max_model_len}. Fix: more num_blocks, a larger dcp, or fewer tokens")
        return ids, max_new, arr

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int] = 32,
                 arrivals: Sequence[int] | None = None) -> list[list[int]]:
        """Greedy-decode each prompt (every rank calls this with the same arguments);
        returns the generated token ids per prompt.

        Continuous batching (`cp_compile.serving.loop.scheduler`): requests join as soon as a batch slot and
        their whole KV budget (prompt + max_new_tokens) are free, and leave when done
        (max_new_tokens or EOS). `arrivals[i]`: the step before which prompt i may not
        join (to exercise joins mid-run); default all at step 0. For sampling, text
        and ranks started for you, use `cp_compile.LLM`."""
        prompts, max_new, arrivals = self._check_generate(prompts, max_new_tokens, arrivals)
        n = len(prompts)
        # The one step loop (loop.step_loop.StepLoop, as under LLM, the server and spec decode) with this
        # engine as its in-process executor; greedy: the sampler's argmax of each row.
        loop = StepLoop(self, self.scheduler())
        eos = frozenset(self.eos)
        seqs = [SchedSequence(i, list(p), max_new[i], eos,
                              payload=RequestState(SamplingParams(temperature=0, max_tokens=max_new[i]), None,
                                                   logits=[] if self.record_logits else None))
                for i, p in enumerate(prompts)]
        total = sum(max_new)
        bar = None
        show = self.progress if self.progress is not None else total >= 256
        if show and self.rank == 0:
            from tqdm.auto import tqdm

            bar = tqdm(total=total, desc="cp_compile.serving.hf generate", unit="tok")
        step = 0  # loop steps so far, planned or not: what `arrivals` counts

        def may_join(seq: SchedSequence) -> bool:
            return arrivals[seq.rid] <= step

        def progress(updated: list[SchedSequence]) -> None:
            nonlocal step
            step += 1
            if bar is not None:
                bar.update(len(updated))

        try:
            for i in sorted(range(n), key=lambda i: arrivals[i]):
                loop.submit(seqs[i])
            loop.run_until_done(progress, may_join)  # the last plan frees the last leavers' blocks
        except BaseException:
            # Give back every block this call took (the engine's allocator outlives the
            # call; a failed step may have allocated before it raised), then re-raise.
            loop.drop(seqs)
            raise
        finally:
            if bar is not None:
                bar.close()
        self.last_logits = {i: seqs[i].payload.logits for i in range(n)} if self.record_logits else {}
        return [seqs[i].output for i in range(n)]
