"""Tensor parallelism for an unmodified HF model, on `init_parallel`'s TP group.

HF's stock TP plan shards `k_proj` / `v_proj` column-wise, which fails when TP has
more ranks than KV heads, exactly where DCP applies. This plan, built from the HF
config, shards in place:

| module | how |
|---|---|
| `q_proj` / `q_b_proj` (rows = heads) | column-parallel: this rank's `Hq / tp` heads |
| `k_proj`, `v_proj` | tp <= Hkv: this rank's `Hkv / tp` heads; tp > Hkv: KV head `rank // (tp // Hkv)`, replicated over `tp // Hkv` ranks (the ranks of one DCP group share it) |
| `kv_b_proj` (MLA) | column-parallel by heads; `kv_a_proj_with_mqa` (the latent) replicated |
| `o_proj`, `down_proj` | row-parallel, then a functional all-reduce over the TP group (visible to the passes) |
| `gate_proj`, `up_proj` | column-parallel |
| MoE blocks (`experts` + `gate` [+ `shared_experts`]) | every expert sharded by its intermediate dim, router replicated, one all-reduce of the block output (`moe.py`) |
| embeddings, norms, `lm_head` | replicated |

The KV heads a rank holds are `cp_compile.runtime.kv_cache.tp_kv_head_ids`, the same
function the cache layout check uses, so the DCP group check sees the truth.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

from cp_compile.base.config import ConfigError
from cp_compile.serving.hf.moe import is_moe_block, shard_moe_block
from cp_compile.serving.hf.selection import select
from cp_compile.serving.hf.support import check_supported, head_dim
from cp_compile.runtime.kv_cache import tp_kv_head_ids


SHARDED_ATTR = "cp_tp_plan"  # set on a model once sharded: its plan (sharding twice would cut shards again)


class RowParallelLinear(nn.Module):
    """y = all_reduce_sum(x_local @ W_local^T) + b: the input dim is sharded."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # [out, in / tp]
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in / tp] -> [..., out]
        y = funcol.all_reduce(nn.functional.linear(x, self.weight), "sum", self.group)
        return y if self.bias is None else y + self.bias


def _rows(linear: nn.Linear, index: torch.Tensor) -> None:
    """Keep output rows `index` of `linear` (column-parallel shard)."""
    on = index.to(linear.weight.device)  # built on the host at load time; index on the weight's device
    with torch.no_grad():
        linear.weight = select(nn.Parameter(linear.weight[on].clone(), requires_grad=False), 0, index)
        if linear.bias is not None:
            linear.bias = select(nn.Parameter(linear.bias[on].clone(), requires_grad=False), 0, index)
    linear.out_features = int(index.numel())


def _head_rows(heads: tuple[int, ...] | range, dim: int) -> torch.Tensor:
    return torch.cat([torch.arange(h * dim, (h + 1) * dim) for h in heads])


def _row_parallel(linear: nn.Linear, index: torch.Tensor, group: dist.ProcessGroup) -> RowParallelLinear:
    w = linear.weight.detach()[:, index.to(linear.weight.device)].clone()
    b = None if linear.bias is None else linear.bias.detach().clone()
    out = RowParallelLinear(w, b, group)
    select(out.weight, 1, index)
    return out


def _split(total: int, tp: int, rank: int, what: str, field: str) -> range:
    if total % tp:
        raise ConfigError(f"{field} divisible by tensor_parallel_size", f"{field}={total}, tp={tp}",
                          f"choose tp dividing {total} ({what})")
    per = total // tp
    return range(rank * per, (rank + 1) * per)


def check_groups_agree(model: nn.Module, tp_group: dist.ProcessGroup | None) -> None:
    """A model HF already sharded (`tp_plan` / `DistributedConfig`) must have used the
    same ranks as `init_parallel`'s TP group; we refuse it either way, since its
    k/v split does not replicate KV heads the way DCP needs."""
    mesh = getattr(model, "_device_mesh", None) or getattr(model, "device_mesh", None)
    if mesh is None:
        return
    try:
        hf_ranks = sorted(int(r) for r in mesh.mesh.flatten().tolist())
    except Exception:  # noqa: BLE001 - a mesh we cannot read is a mesh we cannot check
        hf_ranks = None
    ours = sorted(dist.get_process_group_ranks(tp_group)) if tp_group is not None else [0]
    raise ConfigError("the HF model is loaded unsharded (cp_compile.serving.hf applies its own TP plan)",
                      f"HF device mesh ranks {hf_ranks}, init_parallel TP group ranks {ours}",
                      "load the model without tp_plan / distributed_config and let cp_compile.serving.hf.shard_model "
                      "shard it on init_parallel's TP group")


def shard_model(model: nn.Module, tp: int, tp_rank: int, tp_group: dist.ProcessGroup | None) -> dict[str, Any]:
    """Shard `model` (an HF `*ForCausalLM`) in place for TP rank `tp_rank` of `tp`.
    Returns the plan it applied (head ids per rank) for logs and tests. A model the
    rank-local loader already sharded (`rank_load.py`) is returned as is, after checking
    it was sharded for this `tp` / `tp_rank`."""
    cfg = model.config
    kind = check_supported(cfg)
    check_groups_agree(model, tp_group)
    done = getattr(model, SHARDED_ATTR, None)
    if done is not None:
        if (done["tp"], done.get("tp_rank", 0)) != (tp, tp_rank):
            raise ConfigError("a model sharded for this TP rank", f"sharded for tp={done['tp']} rank "
                              f"{done.get('tp_rank', 0)}, serving tp={tp} rank {tp_rank}",
                              "load the checkpoint with the same tensor_parallel_size and rank as the Engine")
        return done
    plan = _shard(model, cfg, kind, tp, tp_rank, tp_group)
    setattr(model, SHARDED_ATTR, plan)
    return plan


def _shard(model: nn.Module, cfg: Any, kind: str, tp: int, tp_rank: int,
           tp_group: dist.ProcessGroup | None) -> dict[str, Any]:
    if tp == 1:
        return {"tp": 1}
    if tp_group is None:
        raise ConfigError("a TP group for tp > 1", f"tp={tp}, tp_group=None",
                          "call cp_compile.init_parallel(cfg) first and pass state.tp_group")
    hq = cfg.num_attention_heads
    q_heads = _split(hq, tp, tp_rank, "query heads", "num_attention_heads")
    inter = _split(cfg.intermediate_size, tp, tp_rank, "MLP width", "intermediate_size")
    plan: dict[str, Any] = {"tp": tp, "tp_rank": tp_rank, "q_heads": tuple(q_heads)}
    for layer in model.model.layers:
        attn = layer.self_attn
        if kind == "gqa":  # (sfa: MLA heads below; the indexer is replicated)
            hkv = getattr(cfg, "num_key_value_heads", None) or hq
            if tp > hkv and tp % hkv:
                raise ConfigError("tp % num_key_value_heads == 0 when tp > num_key_value_heads",
                                  f"tp={tp}, num_key_value_heads={hkv}",
                                  "choose tp a multiple of the KV head count, so each KV head is replicated "
                                  "over tp // num_kv_heads ranks")
            d = head_dim(cfg)
            kv_heads = tp_kv_head_ids(hkv, tp, tp_rank)
            plan["kv_heads"] = kv_heads
            _rows(attn.q_proj, _head_rows(q_heads, d))
            _rows(attn.k_proj, _head_rows(kv_heads, d))
            _rows(attn.v_proj, _head_rows(kv_heads, d))
            attn.o_proj = _row_parallel(attn.o_proj, _head_rows(q_heads, d), tp_group)
            # Eager attention reads these; our function reads shapes, but keep them honest.
            attn.num_key_value_groups = len(q_heads) // len(kv_heads)
        else:
            qd = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
            _rows(attn.q_proj if cfg.q_lora_rank is None else attn.q_b_proj, _head_rows(q_heads, qd))
            _rows(attn.kv_b_proj, _head_rows(q_heads, cfg.qk_nope_head_dim + cfg.v_head_dim))
            attn.o_proj = _row_parallel(attn.o_proj, _head_rows(q_heads, cfg.v_head_dim), tp_group)
            plan["kv_heads"] = ("latent (replicated)",)
        if hasattr(attn, "num_heads"):
            attn.num_heads = len(q_heads)
        mlp = layer.mlp
        if is_moe_block(mlp):  # routed (+ shared) experts: cp_compile/serving/hf/moe.py
            layer.mlp = shard_moe_block(mlp, tp, tp_rank, tp_group)
            plan["moe_layers"] = plan.get("moe_layers", 0) + 1
            continue
        idx = torch.arange(inter.start, inter.stop)
        _rows(mlp.gate_proj, idx)
        _rows(mlp.up_proj, idx)
        mlp.down_proj = _row_parallel(mlp.down_proj, idx, tp_group)
    return plan
