"""Speculative decoding over the example models (shared by the quick start, the decode
benchmark and the tests): the target, its proposer and their caches on one rank.

Proposers: `"mtp"` for the DeepSeek-style models (MLA, SFA: the DeepSeek-V3 MTP
layer, `examples/models/deepseek_mtp.py`), `"draft"` (a separate tiny random Qwen3)
or `"layer_skip"` (the target's first layer and head) for the GQA model
(`examples/models/draft.py`). Both caches come from `allocate_kv_cache` with the same
config and number of blocks, so they are sharded over the same pcp * dcp ranks and
the proposer reads the target's block tables (`cp_compile.serving.spec_decode`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

import cp_compile
from cp_compile.serving.spec_decode import DraftProposer, Rollback, Sampler, SpecDecoder
from examples.models.deepseek_mtp import WithHidden, build_mtp, has_mtp, random_mtp_tensors
from examples.models.draft import layer_skip_draft, tiny_draft_hf
from examples.models.qwen3 import Qwen3Config
from examples.models.tiny import example_from_config
from examples.serving import layer_caches

PROPOSERS = ("mtp", "draft", "layer_skip")


def default_proposer(model_type: str) -> str:
    return "draft" if model_type == "qwen3" else "mtp"


def proposer_weights(proposer: str, hf_config: Any, state_dict: dict[str, torch.Tensor]
                     ) -> tuple[dict[str, torch.Tensor], Any, dict[str, torch.Tensor] | None]:
    """Built once, in the parent, so every rank and the single-device reference load the
    same full weights: (target state dict, with the MTP layer's HF-named tensors added when
    the checkpoint has none; the draft's HF config and state dict, for "draft")."""
    if proposer == "mtp":
        if hf_config.model_type == "qwen3":
            raise ValueError("proposer 'mtp' is the DeepSeek-V3 MTP layer: use it with the MLA / SFA models "
                             "(or proposer 'draft' / 'layer_skip' for the GQA model)")
        if not has_mtp(state_dict, hf_config.num_hidden_layers):
            state_dict = {**state_dict, **random_mtp_tensors(example_from_config(hf_config, state_dict))}
        return state_dict, None, None
    if hf_config.model_type != "qwen3":
        raise ValueError(f"proposer {proposer!r} drafts for the GQA model; the MLA / SFA models use 'mtp'")
    if proposer == "draft":
        draft = tiny_draft_hf(hf_config)
        return state_dict, draft.config, {k: v.detach().clone() for k, v in draft.state_dict().items()}
    return state_dict, None, None


@dataclass
class SpecModels:
    """One rank's target and proposer, their caches, and the compiled entries (for graph counts)."""

    target: Callable[..., Any]
    target_caches: list[tuple[torch.Tensor, ...]]
    proposer: DraftProposer | None
    compiled: dict[str, Any] = field(default_factory=dict)

    def graphs(self) -> dict[str, dict[Any, int]]:
        """Graphs compiled per model and batch kind (a recompile adds one)."""
        return {name: {kind: len(b.pass_managers) for kind, b in c.backends.items()}
                for name, c in self.compiled.items()}


def build(cfg: cp_compile.CPConfig, hf_config: Any, state_dict: dict[str, torch.Tensor], proposer: str | None,
          k: int, num_blocks: int, tp_rank: int = 0, tp_group: Any = None, lowering: str | None = None,
          draft_lowering: str | None = None, draft_hf: tuple[Any, dict[str, torch.Tensor]] | None = None,
          padding: int = 0, max_blocks_per_req: int | None = None, device: str = "cpu") -> SpecModels:
    """Target (+ proposer when `proposer` and k > 0) on this rank; lowering None = eager, uncompiled."""
    tp = cfg.tensor_parallel_size
    model = example_from_config(hf_config, state_dict, tp, tp_rank, tp_group)
    cache = cp_compile.allocate_kv_cache(cfg, model.kv_cache_spec(), num_blocks, device=device,
                                         attention=model.attention_spec())
    spec_k = k if proposer else 0
    target: Any = WithHidden(model) if proposer == "mtp" and spec_k else model
    out = SpecModels(target, layer_caches(cache), None)
    if lowering is not None:
        out.target = cp_compile.compile_model(target, lowering=lowering, num_speculative_tokens=spec_k)
        out.compiled["target"] = out.target
    if not spec_k:
        return out
    if proposer == "mtp":
        draft: Any = build_mtp(model, state_dict, tp_group=tp_group)
        dynamic = ("input_ids", "positions", "hidden", "meta")
    elif proposer == "layer_skip":
        draft = layer_skip_draft(Qwen3Config.from_hf(hf_config), state_dict, tp, tp_rank, tp_group)
        dynamic = ("input_ids", "positions", "meta")
    else:
        assert draft_hf is not None, "proposer 'draft' needs draft_hf (proposer_weights)"
        draft = example_from_config(draft_hf[0], draft_hf[1], tp, tp_rank, tp_group)
        dynamic = ("input_ids", "positions", "meta")
    dcache = cp_compile.allocate_kv_cache(cfg, draft.kv_cache_spec(), num_blocks, device=device,
                                          attention=draft.attention_spec())
    fwd: Any = draft
    if draft_lowering is not None:
        fwd = cp_compile.compile_model(draft, lowering=draft_lowering, dynamic_args=dynamic,
                                       num_speculative_tokens=spec_k)
        out.compiled["draft"] = fwd
    out.proposer = DraftProposer(fwd, layer_caches(dcache), spec_k, uses_target_hidden=proposer == "mtp",
                                 padding=padding, max_blocks_per_req=max_blocks_per_req)
    return out


def decoder(models: SpecModels, cfg: cp_compile.CPConfig, num_blocks: int, temperature: float = 0.0,
            seed: int = 0, padding: int = 0, max_blocks_per_req: int | None = None,
            on_rollback: Callable[[Rollback], None] | None = None, device: str = "cpu", top_k: int = -1,
            top_p: float = 1.0) -> SpecDecoder:
    """A `SpecDecoder` over the models, with a fresh allocator (virtual blocks of the config)."""
    alloc = cp_compile.BlockAllocator(num_blocks, cfg.virtual_block_size)
    sampler = Sampler(temperature, seed, top_k=top_k, top_p=top_p)
    return SpecDecoder(models.target, models.target_caches, alloc, models.proposer, sampler,
                       padding=padding, max_blocks_per_req=max_blocks_per_req, device=device,
                       on_rollback=on_rollback)
