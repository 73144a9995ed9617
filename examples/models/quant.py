"""W8A8 row-parallel linear for the example models (the o_proj option), quantised
deterministically from a full float weight.

`W8A8Config(mode="dynamic")`: int8 weight with a per-output-channel scale (symmetric,
scale = max_j |W[o, j]| / 127 over the *full* row, so every TP shard quantises with
the same scale) and offset 0; activations quantised per token at run time, each
rank over its own input shard (`act_groups` slices of the full input dim, default
one per shard of the TP size the model is built for).

`W8A8Config(mode="static", input_scales=(...), input_offsets=(...))`: the same int8
weight; one calibrated activation scale and offset per input group (len(input_scales)
groups over the full input dim, each TP rank holds len / tp of them). The weight
scale folds into `deq_scale[g, o] = s_g * s_w[o]`, and the offset into
`quant_bias[g, o] = -o_g * sum_{j in g} W_q[o, j]` (int32), vLLM-Ascend's parameter
set for W8A8 static.

The module is a drop-in for `common.RowParallelLinear` (same constructor
arguments, `load_full`, all-reduce over the TP group, bias added after it) and runs
`cp::w8a8_dynamic_linear` / `cp::w8a8_static_linear` (`ops/quant/ops.py`) on its shard.
Parameters are `nn.Parameter(requires_grad=False)` so that `@cp_module(o_proj=...)`
roles name them like the float weight.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn

import cp_compile.ops.quant.ops  # noqa: F401  (registers cp::w8a8_*_linear)
from cp_compile.ops.quant.reference import QMAX

from examples.models.common import _copy_param, shard, tp_all_reduce


@dataclass(frozen=True)
class W8A8Config:
    mode: Literal["dynamic", "static"]
    # dynamic: per-token activation groups over the full input dim (None: one per TP shard).
    act_groups: int | None = None
    # static: calibrated activation scale and zero point per input group.
    input_scales: tuple[float, ...] = (0.05,)
    input_offsets: tuple[int, ...] = (0,)

    def __post_init__(self) -> None:
        if self.mode not in ("dynamic", "static"):
            raise ValueError(f"W8A8Config.mode={self.mode!r}: use 'dynamic' or 'static'")
        if len(self.input_scales) != len(self.input_offsets) or not self.input_scales:
            raise ValueError(f"W8A8Config: one input offset per input scale, got {len(self.input_scales)} scales "
                             f"and {len(self.input_offsets)} offsets")

    def groups(self, tp_size: int) -> int:
        """Activation groups over the full input dim."""
        if self.mode == "static":
            return len(self.input_scales)
        return tp_size if self.act_groups is None else self.act_groups


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Full float weight [out, in] -> (int8 [out, in], per-output-channel scale fp32 [out]); symmetric."""
    w = weight.float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))
    return torch.clamp(torch.round(w / scale[:, None]), -QMAX, QMAX).to(torch.int8), scale


class W8A8RowParallelLinear(nn.Module):
    """y = all_reduce_sum(w8a8_linear(x_local, W_local)) (+ b): the input dim is sharded.

    Rank r holds input columns [r*k, (r+1)*k) (k = in / tp) as a K-major int8 weight
    [k, out] and its activation groups' parameters (groups / tp of them).
    """

    def __init__(self, in_features: int, out_features: int, tp_size: int = 1, tp_rank: int = 0,
                 bias: bool = False, tp_group: dist.ProcessGroup | None = None,
                 quant: W8A8Config | None = None) -> None:
        super().__init__()
        if quant is None:
            raise ValueError("W8A8RowParallelLinear needs a W8A8Config")
        groups = quant.groups(tp_size)
        if in_features % tp_size or groups % tp_size or in_features % groups:
            raise ValueError(f"W8A8RowParallelLinear: in_features={in_features}, activation groups={groups}, "
                             f"tp_size={tp_size}: need both divisible by tp_size and in_features by groups")
        self.in_features, self.out_features = in_features, out_features
        self.tp_size, self.tp_rank, self.tp_group = tp_size, tp_rank, tp_group
        self.quant = quant
        self.local_groups = groups // tp_size
        k = in_features // tp_size

        def frozen(t: torch.Tensor) -> nn.Parameter:
            return nn.Parameter(t, requires_grad=False)

        self.weight = frozen(torch.zeros(k, out_features, dtype=torch.int8))  # [in/tp, out]
        if quant.mode == "dynamic":
            self.weight_scale = frozen(torch.ones(out_features))  # [out]
            self.weight_offset = frozen(torch.zeros(out_features, dtype=torch.int32))  # [out]
        else:
            g = self.local_groups
            self.input_scale = frozen(torch.ones(g))  # [G/tp]
            self.input_offset = frozen(torch.zeros(g, dtype=torch.int32))  # [G/tp]
            self.quant_bias = frozen(torch.zeros(g, out_features, dtype=torch.int32))  # [G/tp, out]
            self.deq_scale = frozen(torch.ones(g, out_features))  # [G/tp, out]
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    @property
    def kind(self) -> str:
        return f"w8a8_{self.quant.mode}"

    def local_linear(self, x: torch.Tensor) -> torch.Tensor:  # [T, in/tp] -> [T, out] (this shard's sum)
        if self.quant.mode == "dynamic":
            return torch.ops.cp.w8a8_dynamic_linear(x, self.weight, self.weight_scale, self.weight_offset,
                                                    self.local_groups)
        return torch.ops.cp.w8a8_static_linear(x, self.weight, self.input_scale, self.input_offset,
                                               self.quant_bias, self.deq_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in/tp] -> [T, out]
        y = self.local_linear(x)
        if self.tp_size > 1:
            if self.tp_group is None:
                raise RuntimeError("W8A8RowParallelLinear with tp_size > 1 needs a tp_group for its all-reduce")
            y = tp_all_reduce(y, self.tp_group)
        if self.bias is not None:
            y = y + self.bias
        return y

    def load_full(self, weight: torch.Tensor, bias: torch.Tensor | None = None, name: str = "") -> None:
        """Quantise the full float weight [out, in] (deterministic) and keep this rank's shard."""
        w_q, w_s = quantize_weight(weight)  # [out, in] int8, [out]
        _copy_param(self.weight, shard(w_q, 1, self.tp_size, self.tp_rank).t(), name + ".weight")
        if self.quant.mode == "dynamic":
            _copy_param(self.weight_scale, w_s, name + ".weight_scale")
            _copy_param(self.weight_offset, torch.zeros_like(self.weight_offset), name + ".weight_offset")
        else:
            G = self.quant.groups(self.tp_size)
            s = torch.tensor(self.quant.input_scales, dtype=torch.float32)  # [G]
            o = torch.tensor(self.quant.input_offsets, dtype=torch.int32)  # [G]
            wsum = w_q.to(torch.int32).view(self.out_features, G, -1).sum(-1).t()  # [G, out]
            qb = -o[:, None] * wsum  # [G, out] int32
            deq = s[:, None] * w_s[None, :]  # [G, out] fp32
            own = slice(self.tp_rank * self.local_groups, (self.tp_rank + 1) * self.local_groups)
            for pname, value in (("input_scale", s[own]), ("input_offset", o[own]), ("quant_bias", qb[own]),
                                 ("deq_scale", deq[own])):
                _copy_param(getattr(self, pname), value, f"{name}.{pname}")
        if (bias is None) != (self.bias is None):
            raise ValueError(f"{name}: bias present in checkpoint={bias is not None}, in model={self.bias is not None}")
        if bias is not None:
            _copy_param(self.bias, bias, name + ".bias")


def row_parallel_o_proj(in_features: int, out_features: int, tp_size: int, tp_rank: int, bias: bool,
                        tp_group: dist.ProcessGroup | None, quant: W8A8Config | None) -> nn.Module:
    """The example models' o_proj: float `RowParallelLinear`, or W8A8 when `quant` is given."""
    from examples.models.common import RowParallelLinear

    if quant is None:
        return RowParallelLinear(in_features, out_features, tp_size, tp_rank, bias, tp_group)
    return W8A8RowParallelLinear(in_features, out_features, tp_size, tp_rank, bias, tp_group, quant)


class W8A8ColumnLinear(nn.Module):
    """y_local = w8a8_dynamic_linear(x, W_local): the MLA projections (q_a / q_b / q_proj /
    kv_a_proj_with_mqa) as W8A8 dynamic linears, output dim sharded (tp_size 1: replicated).

    The full float weight [out, in] is quantised per output channel (each channel's
    scale depends only on its own row, so a shard quantises as the full weight does)
    and rank r keeps output channels [r*n, (r+1)*n) as a K-major int8 [in, n].
    Activations are quantised per token over the whole input (one group): every
    rank sees the full input of a column-parallel linear.
    """

    def __init__(self, in_features: int, out_features: int, tp_size: int = 1, tp_rank: int = 0,
                 bias: bool = False) -> None:
        super().__init__()
        if bias:
            raise ValueError("W8A8ColumnLinear: biased MLA projections are not built (attention_bias=True); "
                             "use the float projections (mla_quant=None)")
        if out_features % tp_size:
            raise ValueError(f"W8A8ColumnLinear: out_features={out_features} not divisible by tp_size={tp_size}")
        self.tp_size, self.tp_rank = tp_size, tp_rank
        n = out_features // tp_size

        def frozen(t: torch.Tensor) -> nn.Parameter:
            return nn.Parameter(t, requires_grad=False)

        self.weight = frozen(torch.zeros(in_features, n, dtype=torch.int8))  # [in, out/tp]
        self.weight_scale = frozen(torch.ones(n))  # [out/tp]
        self.weight_offset = frozen(torch.zeros(n, dtype=torch.int32))  # [out/tp]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out/tp]
        return torch.ops.cp.w8a8_dynamic_linear(x, self.weight, self.weight_scale, self.weight_offset, 1)

    def load_full(self, weight: torch.Tensor, bias: torch.Tensor | None = None, name: str = "") -> None:
        """Quantise the full float weight [out, in] and keep this rank's output channels."""
        if bias is not None:
            raise ValueError(f"{name}: W8A8ColumnLinear has no bias, the checkpoint has one")
        w_q, w_s = quantize_weight(weight)  # [out, in] int8, [out]
        _copy_param(self.weight, shard(w_q, 0, self.tp_size, self.tp_rank).t(), name + ".weight")
        _copy_param(self.weight_scale, shard(w_s, 0, self.tp_size, self.tp_rank), name + ".weight_scale")
        _copy_param(self.weight_offset, torch.zeros_like(self.weight_offset), name + ".weight_offset")
