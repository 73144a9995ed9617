"""Mixture-of-experts layers of an unmodified HF model under TP: every expert sharded
by its intermediate dim (TP-sharded experts), the router replicated.

HF's MoE blocks (`DeepseekV2Moe`, `DeepseekV3MoE` / V3.2 / GLM-5, `Qwen3MoeSparseMoeBlock`)
compute `y = sum_k w_k(x) * E_{i_k}(x) [+ S(x)]` with `E(x) = down(act(gate x) * up x)`.
With each expert's (and the shared expert's) intermediate columns split over the TP
ranks, each rank's `down` produces a partial sum of the same `y`; the routing
weights multiply linearly, so one all-reduce of the block's output gives HF's `y`
exactly (up to float order). The router (`gate`) runs replicated on the full hidden
state, so every rank picks the same experts with HF's own gating code (sigmoid +
group-limited top-k + correction bias for V3, softmax top-k for V2 / Qwen3).

HF's 3D expert tensors: `gate_up_proj [E, 2I, H]` ([gate; up] rows) and
`down_proj [E, H, I]`. This rank keeps gate rows `idx`, up rows `I + idx` and down
columns `idx` for `idx` its `I / tp` slice. The experts run through HF's
`batched_mm` implementation (a per-token gather of expert weights: no data-dependent
shapes, so one compiled graph for every routing), selected via
`config._experts_implementation`.

Why not expert parallel: decisions.md 35 (issue 23).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

from cp_compile.base.config import ConfigError
from cp_compile.serving.hf.selection import select

EXPERTS_IMPLEMENTATION = "batched_mm"


class AllReduceOutput(nn.Module):
    """Wraps an HF MoE block whose experts are TP-sharded: y = all_reduce_sum(block(x))."""

    def __init__(self, block: nn.Module, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.block = block
        self.group = group

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return funcol.all_reduce(self.block(hidden_states), "sum", self.group)


def is_moe_block(mlp: nn.Module) -> bool:
    experts = getattr(mlp, "experts", None)
    return experts is not None and isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor)


def _shard_experts(experts: nn.Module, idx: torch.Tensor) -> None:
    if getattr(experts, "has_bias", False) or not getattr(experts, "is_concatenated", True) or \
            getattr(experts, "is_transposed", False):
        raise ConfigError("HF experts with concatenated [gate; up] weights, no bias, not transposed",
                          f"{type(experts).__name__}: has_bias={getattr(experts, 'has_bias', None)}, "
                          f"is_concatenated={getattr(experts, 'is_concatenated', None)}, "
                          f"is_transposed={getattr(experts, 'is_transposed', None)}",
                          "serve a DeepSeek-V2/V3/V3.2, GLM-5 or Qwen3-MoE checkpoint (the layouts sharded here)")
    inter = experts.down_proj.shape[-1]
    with torch.no_grad():
        gate_up = experts.gate_up_proj.detach()
        rows = torch.cat([idx, inter + idx])
        experts.gate_up_proj = select(nn.Parameter(gate_up[:, rows.to(gate_up.device)].clone(), requires_grad=False),
                                       1, rows)  # [E, 2I/tp, H]
        down = experts.down_proj.detach()
        experts.down_proj = select(nn.Parameter(down[:, :, idx.to(down.device)].clone(), requires_grad=False),
                                    2, idx)  # [E, H, I/tp]
    experts.intermediate_dim = int(idx.numel())


def _shard_dense_partial(mlp: nn.Module, tp: int, rank: int) -> None:
    """A gate/up/down MLP sharded by columns whose down projection is NOT reduced
    (the shared expert: the block's single all-reduce sums it with the experts)."""
    inter = mlp.gate_proj.out_features
    if inter % tp:
        raise ConfigError("shared-expert width divisible by tensor_parallel_size",
                          f"moe_intermediate_size * n_shared_experts={inter}, tp={tp}", f"choose tp dividing {inter}")
    if any(getattr(mlp, n).bias is not None for n in ("gate_proj", "up_proj", "down_proj")):
        raise ConfigError("shared experts without biases", "mlp_bias=True",
                          "serve a checkpoint with mlp_bias=False (a bias would be added tp times)")
    per = inter // tp
    idx = torch.arange(rank * per, (rank + 1) * per)
    with torch.no_grad():
        for name in ("gate_proj", "up_proj"):
            lin = getattr(mlp, name)
            w = lin.weight.detach()
            lin.weight = select(nn.Parameter(w[idx.to(w.device)].clone(), requires_grad=False), 0, idx)
            lin.out_features = per
        down = mlp.down_proj
        w = down.weight.detach()
        down.weight = select(nn.Parameter(w[:, idx.to(w.device)].clone(), requires_grad=False), 1, idx)
        down.in_features = per


def shard_moe_block(mlp: nn.Module, tp: int, rank: int, group: dist.ProcessGroup) -> AllReduceOutput:
    """Shard an HF MoE block in place for TP rank `rank`; returns the wrapper to put
    in its place (`layer.mlp = shard_moe_block(layer.mlp, ...)`)."""
    experts = mlp.experts
    inter = experts.down_proj.shape[-1]
    if inter % tp:
        raise ConfigError("moe_intermediate_size divisible by tensor_parallel_size",
                          f"moe_intermediate_size={inter}, tp={tp}", f"choose tp dividing {inter}")
    per = inter // tp
    _shard_experts(experts, torch.arange(rank * per, (rank + 1) * per))
    shared = getattr(mlp, "shared_experts", None)
    if shared is not None:
        _shard_dense_partial(shared, tp, rank)
    if getattr(mlp, "shared_expert_gate", None) is not None:
        raise ConfigError("MoE blocks without a gated shared expert", f"{type(mlp).__name__}.shared_expert_gate",
                          "serve DeepSeek-V2/V3/V3.2, GLM-5 or Qwen3-MoE (Qwen2-MoE's sigmoid-gated shared "
                          "expert is not sharded here)")
    return AllReduceOutput(mlp, group)
