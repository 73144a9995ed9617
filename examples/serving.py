"""A fixed greedy serving schedule over the example models (shared by the quick start,
the compiled-model tests and the benchmark), stepped by the one step loop
(`cp_compile.serving.loop.step_loop.StepLoop`).

Requests join and leave between steps, so the batch composition and the token
count change every step: prefills of joining requests ride in the same flattened
batch as the decodes of running ones (mixed batches). The metadata is global (what
one device would see); the model, compiled or not, receives exactly that.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from cp_compile.base.config import CPConfig
from cp_compile.runtime.kv_cache import KVCache
from cp_compile.serving.kv_transfer import KVConsumer, KVProducer, KVTransferConfig
from cp_compile.runtime.metadata_build import BlockAllocator
from cp_compile.base.sampling import SamplingParams
from cp_compile.serving.loop.forward_executor import ForwardExecutor
from cp_compile.serving.loop.scheduler import Scheduler, Sequence
from cp_compile.serving.loop.step_loop import RequestState, StepLoop


def layer_caches(cache: KVCache) -> list[tuple[torch.Tensor, ...]]:
    """The per-layer cache tuples the example models' forward takes: `cache.layers[i]`
    (DCP-sharded: K/V or the latent), then layer i's replicated indexer cache when the
    model has one (SFA: `(latent, index_cache)`)."""
    if not cache.replicated:
        return cache.layers
    if len(cache.replicated) != len(cache.layers):
        raise ValueError(f"{len(cache.replicated)} replicated caches for {len(cache.layers)} layers")
    return [layer + (index,) for layer, index in zip(cache.layers, cache.replicated)]


@dataclass
class Schedule:
    """prompts[rid]: prompt tokens; joins[step]: rids that start at that step;
    leaves[step]: rids that finish before that step; padding: padding tokens per step."""

    prompts: dict[int, list[int]]
    joins: dict[int, list[int]]
    leaves: dict[int, list[int]] = field(default_factory=dict)
    num_steps: int = 10
    padding: int = 0


@dataclass
class StepResult:
    req_ids: list[int]
    last_logits: torch.Tensor  # [B, vocab] logits of each request's last token
    next_tokens: list[int]


def tiny_schedule(vocab: int, seed: int = 0, num_steps: int = 10) -> Schedule:
    """Prefill of two requests, then decodes; a third joins mid-way (mixed batch,
    several prefill tokens beside decodes) and one leaves: lengths and batch
    composition change every step."""
    g = torch.Generator().manual_seed(seed)
    prompts = {0: torch.randint(0, vocab, (7,), generator=g).tolist(),
               1: torch.randint(0, vocab, (3,), generator=g).tolist(),
               2: torch.randint(0, vocab, (5,), generator=g).tolist()}
    return Schedule(prompts=prompts, joins={0: [0, 1], 3: [2]}, leaves={7: [1]}, num_steps=num_steps, padding=2)


def run_schedule(forward: Callable[..., torch.Tensor], kv_layers: list[tuple[torch.Tensor, ...]], cfg: CPConfig,
                 num_blocks: int, schedule: Schedule, max_blocks_per_req: int = 8,
                 on_step: Callable[[int, Any], None] | None = None) -> list[StepResult]:
    """Greedy decoding through `forward(input_ids, positions, kv_layers, meta)`, stepped
    by the one step loop (`cp_compile.serving.loop.step_loop.StepLoop`) over a
    `ForwardExecutor`: its scheduler admits each request at its join step with a budget
    of the steps it runs (so it leaves, and its blocks are freed, at its leave step),
    and the one `Sampler` picks the greedy tokens.

    `cfg` gives the virtual block size (block_size * dcp), the same on every rank
    and for the single-device reference with pages of that size. `on_step(step, meta)`
    sees each step's metadata; the batch order is the order of joining.
    """
    vbs = cfg.virtual_block_size
    executor = ForwardExecutor(forward, kv_layers, BlockAllocator(num_blocks, vbs), padding=schedule.padding,
                               max_blocks_per_req=max_blocks_per_req)
    loop = StepLoop(executor, Scheduler(num_blocks, vbs, max_batch=max(len(schedule.prompts), 1)))
    leave_at = {rid: step for step, rids in schedule.leaves.items() for rid in rids}
    greedy = SamplingParams(temperature=0, max_tokens=None)
    results: list[StepResult] = []
    for step in range(schedule.num_steps):
        joining = []
        for rid in sorted(schedule.joins.get(step, [])):
            steps = leave_at.get(rid, schedule.num_steps) - step  # the tokens it generates
            if steps < 1:
                raise ValueError(f"schedule: request {rid} joins at step {step} and leaves at step "
                                 f"{leave_at.get(rid)}. Fix: leave after the join step")
            joining.append(loop.submit(Sequence(rid, list(schedule.prompts[rid]), steps,
                                                payload=RequestState(greedy, None))))
        ran = loop.step()
        late = [s.rid for s in joining if s not in ran]
        if late:
            raise ValueError(f"schedule step {step}: requests {late} cannot join: their prompt + steps need more "
                             f"KV blocks of {vbs} tokens than are left of {num_blocks}. Fix: more blocks")
        if not ran:
            results.append(StepResult([], torch.empty(0), []))
            continue
        results.append(StepResult([s.rid for s in ran], torch.stack(executor.last).clone(),
                                  [s.tokens[-1] for s in ran]))
        if on_step is not None:
            on_step(step, executor.meta)
    return results


# --------------------------------------------------------------------------- PD disaggregation
#
# The serving loop's two roles when prefill and decode run on different instances
# (`kv_transfer_config`, cp_compile.serving.kv_transfer): a producer instance prefills and
# exports each request's KV; a consumer instance imports it into its own blocks
# (any other tp / dcp / interleave / block size) and decodes from the prefill's
# sampled token. Every rank of an instance runs the same calls on global metadata.


def make_kv_role(kv_transfer_config: Any, cfg: CPConfig, cache: KVCache, model: Any, rank: int,
                 allocator: BlockAllocator, group: Any = None) -> Any:
    """The `KVProducer` or `KVConsumer` the config's kv_role names, over this rank's cache."""
    kv = KVTransferConfig.from_dict(kv_transfer_config)
    spec, attention = model.kv_cache_spec(), model.attention_spec()
    if kv.is_producer:
        return KVProducer(kv, cfg, cache, spec, attention, rank)
    return KVConsumer(kv, cfg, cache, spec, attention, rank, allocator, group=group)


def _greedy_loop(forward: Callable[..., torch.Tensor], kv_layers: list[tuple[torch.Tensor, ...]],
                 allocator: BlockAllocator, max_batch: int, padding: int = 0,
                 max_blocks_per_req: int | None = None) -> tuple[StepLoop, ForwardExecutor]:
    """The one step loop over `forward` and an allocator that may already hold the
    requests' blocks (PD disaggregation: the prefilled or imported KV)."""
    executor = ForwardExecutor(forward, kv_layers, allocator, padding=padding, max_blocks_per_req=max_blocks_per_req)
    return StepLoop(executor, Scheduler(allocator.num_blocks, allocator.block_tokens, max(max_batch, 1))), executor


def _admit_all(loop: StepLoop, seqs: list[Sequence]) -> None:
    """One step that must run every request of `seqs` (the PD examples batch them all)."""
    ran = loop.step()
    if [s.rid for s in ran] != [s.rid for s in seqs]:
        raise ValueError(f"requests {[s.rid for s in seqs if s not in ran]} do not fit the "
                         f"{loop.scheduler.num_blocks} KV blocks beside the others. Fix: more blocks")


def prefill_and_export(forward: Callable[..., torch.Tensor], kv_layers: list[tuple[torch.Tensor, ...]],
                       allocator: BlockAllocator, prompts: dict[int, list[int]], producer: Any,
                       padding: int = 0, max_blocks_per_req: int = 64) -> dict[int, torch.Tensor]:
    """Producer role: prefill every prompt in one batch (one step of the step loop: each
    request leaves after its greedy first token), export each request (its block table
    and that token). Returns each request's last-token logits."""
    loop, executor = _greedy_loop(forward, kv_layers, allocator, len(prompts), padding, max_blocks_per_req)
    greedy = SamplingParams(temperature=0, max_tokens=None)
    seqs = [loop.submit(Sequence(r, list(prompts[r]), 1, payload=RequestState(greedy, None))) for r in sorted(prompts)]
    _admit_all(loop, seqs)  # their blocks stay held (no next plan) until `release_exported`
    for s in seqs:
        producer.export(s.rid, len(s.prompt), allocator.blocks(s.rid), s.tokens[-1])
    return {s.rid: row.clone() for s, row in zip(seqs, executor.last)}


def release_exported(producer: Any, allocator: BlockAllocator, req_ids: list[int]) -> dict[int, str]:
    """Producer role: wait for the consumer's verdict on each request, then free its blocks."""
    verdicts = {}
    for r in req_ids:
        verdicts[r] = producer.wait_consumed(r)
        allocator.free(r)
    return verdicts


def import_and_decode(forward: Callable[..., torch.Tensor], kv_layers: list[tuple[torch.Tensor, ...]],
                      allocator: BlockAllocator, consumer: Any, req_ids: list[int], num_steps: int
                      ) -> tuple[dict[int, list[int]], list[torch.Tensor], dict[int, Any]]:
    """Consumer role: import each request's KV, then greedy-decode all of them together
    for `num_steps` steps of the step loop from the prefill's first token (each request
    starts at `cached` = its imported tokens). Returns (tokens per request: the first
    token then the decoded ones, last logits per step [B, vocab], imports)."""
    imported = {r: consumer.import_request(r) for r in req_ids}
    loop, executor = _greedy_loop(forward, kv_layers, allocator, len(imported), max_blocks_per_req=64)
    greedy = SamplingParams(temperature=0, max_tokens=None)
    seqs = []
    for r in sorted(imported):
        imp = imported[r]
        # The imported positions' tokens are not needed (their KV is cached): placeholders.
        seq = Sequence(r, [0] * imp.num_tokens + [imp.first_token], max(num_steps, 1),
                       payload=RequestState(greedy, None))
        seq.cached = imp.num_tokens
        seqs.append(loop.submit(seq))
    steps = []
    for _ in range(num_steps):
        _admit_all(loop, seqs)
        steps.append(torch.stack(executor.last).clone())  # [B, vocab]: one token per request
    return {s.rid: [imported[s.rid].first_token] + s.output for s in seqs}, steps, imported
