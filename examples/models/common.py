"""Small pieces shared by the example models: RMSNorm, rotary embedding, TP linears.

Tensor parallelism is written plainly (Megatron style): a `ColumnParallelLinear`
holds rows of the full weight (its output is sharded, no communication), a
`RowParallelLinear` holds columns (its input is sharded) and sums the partial
results over the TP group with a functional all-reduce. With `tp_size == 1` (or no
group) there is no collective at all, so a single-device model is ordinary PyTorch.

Everything here is `torch.compile(fullgraph=True)` friendly: no data-dependent
Python control flow, no `.item()`, no in-place ops on inputs.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from cp_compile.base.config import ConfigError
from cp_compile.runtime.metadata_checks import validate_step


# --------------------------------------------------------------------------- norms


def check_config_fields(cfg: Any, positive: tuple[str, ...], even: tuple[str, ...] = (),
                        divides: tuple[tuple[str, str], ...] = ()) -> None:
    """Refuse a model config the ops cannot run, naming the field (issue 19): a zero
    top-k gives zero attention output everywhere, a zero head count an empty tensor,
    a negative one `negative dimension -4` naming nothing. ConfigError, before any
    weight is built."""
    name = type(cfg).__name__
    for f in positive:
        v = getattr(cfg, f)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"{name}.{f} >= 1", f"{f}={v!r}", f"set {f} to a positive integer (the checkpoint's "
                              f"config value; 0 or less describes no model the ops can run)")
    for f in even:
        v = getattr(cfg, f)
        if v % 2:
            raise ConfigError(f"{name}.{f} is even (rotary pairs)", f"{f}={v}",
                              f"use an even {f}: rope rotates pairs of channels")
    for a, b in divides:
        va, vb = getattr(cfg, a), getattr(cfg, b)
        if va % vb:
            raise ConfigError(f"{name}.{a} % {name}.{b} == 0", f"{a}={va}, {b}={vb}",
                              f"choose {b} dividing {a} (each KV head serves {a} // {b} query heads)")


class RMSNorm(nn.Module):
    """RMSNorm over the last dim, computed in fp32 like HF (`weight * norm(x).to(dtype)`)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim] -> [..., dim]
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


# --------------------------------------------------------------------------- rotary


def rope_inv_freq(rotary_dim: int, theta: float) -> torch.Tensor:
    """Inverse frequencies [rotary_dim // 2] (fp32), as HF's default rope."""
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))


class RotaryEmbedding(nn.Module):
    """cos / sin tables for the given positions (no cached table: positions are data).

    forward(positions[T]) -> (cos[T, R/2], sin[T, R/2]) in fp32; frequency i rotates
    the pair (i, i + R/2) in neox style and the pair (2i, 2i+1) in interleaved style.
    """

    def __init__(self, rotary_dim: int, theta: float) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim
        self.register_buffer("inv_freq", rope_inv_freq(rotary_dim, theta), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, R/2]
        return freqs.cos(), freqs.sin()


def apply_rope_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox-style rope (HF `rotate_half`): pairs (i, i + R/2).

    x [T, H, R], cos/sin [T, R/2] -> [T, H, R] in x's dtype.
    """
    half = x.shape[-1] // 2
    c = cos[:, None, :].to(x.dtype)  # [T, 1, R/2]
    s = sin[:, None, :].to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """GPT-J / original DeepSeek rope: pairs (2i, 2i+1), output kept interleaved.

    x [T, H, R], cos/sin [T, R/2] -> [T, H, R]. (HF DeepSeek-V3's
    `apply_rotary_pos_emb_interleave` returns the same values de-interleaved,
    [evens | odds]; applied to both q and k that permutation leaves q.k unchanged.)
    """
    c = cos[:, None, :].to(x.dtype)  # [T, 1, R/2]
    s = sin[:, None, :].to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]  # [T, H, R/2]
    return torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)


# --------------------------------------------------------------------------- tensor parallel


def shard(full: torch.Tensor, dim: int, num_shards: int, index: int) -> torch.Tensor:
    """Contiguous shard `index` of `num_shards` equal shards of `full` along `dim`."""
    size = full.shape[dim]
    if size % num_shards != 0:
        raise ValueError(f"dim {dim} of size {size} does not split into {num_shards} equal shards")
    n = size // num_shards
    return full.narrow(dim, index * n, n)


def _copy_param(param: torch.Tensor, value: torch.Tensor, name: str) -> None:
    if tuple(param.shape) != tuple(value.shape):
        raise ValueError(f"{name}: expected shape {tuple(param.shape)}, got {tuple(value.shape)}")
    with torch.no_grad():
        param.copy_(value)


class ColumnParallelLinear(nn.Module):
    """y_local = x @ W_local^T (+ b_local): the output dim is sharded, no communication.

    The full weight [out_features, in_features] is cut into `num_shards` row blocks
    (default `tp_size`); rank r holds block `r // (tp_size // num_shards)`. With
    `num_shards < tp_size` a block is replicated on `tp_size // num_shards`
    consecutive ranks (GQA KV heads when tp > num_kv_heads).
    """

    def __init__(self, in_features: int, out_features: int, tp_size: int = 1, tp_rank: int = 0,
                 bias: bool = False, num_shards: int | None = None) -> None:
        super().__init__()
        num_shards = tp_size if num_shards is None else num_shards
        if tp_size % num_shards != 0 or out_features % num_shards != 0:
            raise ValueError(f"ColumnParallelLinear: out_features={out_features} into num_shards={num_shards} "
                             f"on tp_size={tp_size}: need tp_size % num_shards == 0 and "
                             f"out_features % num_shards == 0")
        self.in_features = in_features
        self.out_features = out_features  # full (unsharded)
        self.num_shards = num_shards
        self.shard_index = tp_rank // (tp_size // num_shards)
        self.out_per_rank = out_features // num_shards
        self.weight = nn.Parameter(torch.empty(self.out_per_rank, in_features))
        self.bias = nn.Parameter(torch.zeros(self.out_per_rank)) if bias else None
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out_per_rank]
        return F.linear(x, self.weight, self.bias)

    def load_full(self, weight: torch.Tensor, bias: torch.Tensor | None = None, name: str = "") -> None:
        """Copy this rank's rows of the full weight [out_features, in_features] (and bias)."""
        _copy_param(self.weight, shard(weight, 0, self.num_shards, self.shard_index), name + ".weight")
        if (bias is None) != (self.bias is None):
            raise ValueError(f"{name}: bias present in checkpoint={bias is not None}, in model={self.bias is not None}")
        if bias is not None:
            _copy_param(self.bias, shard(bias, 0, self.num_shards, self.shard_index), name + ".bias")


class RowParallelLinear(nn.Module):
    """y = all_reduce_sum(x_local @ W_local^T) (+ b): the input dim is sharded.

    Rank r holds column block r of the full weight [out_features, in_features]. The
    bias (replicated) is added once, after the reduction. The reduction is a torch
    functional collective over `tp_group` and is skipped when tp_size == 1. (A model
    built with tp_size > 1 and no group can load weights but not run forward.)
    """

    def __init__(self, in_features: int, out_features: int, tp_size: int = 1, tp_rank: int = 0,
                 bias: bool = False, tp_group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        if in_features % tp_size != 0:
            raise ValueError(f"RowParallelLinear: in_features={in_features} not divisible by tp_size={tp_size}")
        self.in_features = in_features  # full (unsharded)
        self.out_features = out_features
        self.tp_size = tp_size
        self.tp_rank = tp_rank
        self.tp_group = tp_group
        self.weight = nn.Parameter(torch.empty(out_features, in_features // tp_size))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in/tp] -> [T, out]
        y = F.linear(x, self.weight)
        if self.tp_size > 1:
            if self.tp_group is None:
                raise RuntimeError("RowParallelLinear with tp_size > 1 needs a tp_group for its all-reduce")
            y = tp_all_reduce(y, self.tp_group)
        if self.bias is not None:
            y = y + self.bias
        return y

    def load_full(self, weight: torch.Tensor, bias: torch.Tensor | None = None, name: str = "") -> None:
        """Copy this rank's columns of the full weight [out_features, in_features] (and the bias)."""
        _copy_param(self.weight, shard(weight, 1, self.tp_size, self.tp_rank), name + ".weight")
        if (bias is None) != (self.bias is None):
            raise ValueError(f"{name}: bias present in checkpoint={bias is not None}, in model={self.bias is not None}")
        if bias is not None:
            _copy_param(self.bias, bias, name + ".bias")


def tp_all_reduce(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Sum over the TP group as a functional collective (visible to the compiler passes)."""
    from torch.distributed import _functional_collectives as funcol

    return funcol.all_reduce(x, "sum", group)


class SwiGLUMLP(nn.Module):
    """down(silu(gate(x)) * up(x)); gate/up column-parallel, down row-parallel + all-reduce."""

    def __init__(self, hidden: int, intermediate: int, tp_size: int = 1, tp_rank: int = 0,
                 tp_group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.gate_proj = ColumnParallelLinear(hidden, intermediate, tp_size, tp_rank)
        self.up_proj = ColumnParallelLinear(hidden, intermediate, tp_size, tp_rank)
        self.down_proj = RowParallelLinear(intermediate, hidden, tp_size, tp_rank, tp_group=tp_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def load_hf(self, sd: "StateDictReader", prefix: str) -> None:
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(self, name).load_full(sd.take(f"{prefix}.{name}.weight"), name=f"{prefix}.{name}")


# --------------------------------------------------------------------------- checkpoint loading


class StateDictReader:
    """Hands out tensors of an HF state dict by name and reports what was left unused."""

    def __init__(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        self._sd = dict(state_dict)
        self._used: set[str] = set()

    def take(self, name: str) -> torch.Tensor:
        if name not in self._sd:
            raise KeyError(f"checkpoint has no tensor {name!r}")
        self._used.add(name)
        return self._sd[name]

    def get(self, name: str) -> torch.Tensor | None:
        return self.take(name) if name in self._sd else None

    def has(self, name: str) -> bool:
        return name in self._sd

    def check_all_used(self, ignore_suffixes: tuple[str, ...] = ("rotary_emb.inv_freq",),
                       ignore_prefixes: tuple[str, ...] = ()) -> None:
        left = sorted(k for k in self._sd if k not in self._used and not k.endswith(ignore_suffixes)
                      and not k.startswith(ignore_prefixes))
        if left:
            raise ValueError(f"checkpoint tensors not used by the model: {left[:8]}{' ...' if len(left) > 8 else ''}")


def load_norm(norm: RMSNorm, sd: StateDictReader, name: str) -> None:
    _copy_param(norm.weight, sd.take(name), name)


def load_replicated(param: torch.Tensor, value: torch.Tensor, name: str) -> None:
    _copy_param(param, value, name)


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, self_attn: nn.Module, hidden: int, intermediate: int, eps: float, tp_size: int,
                 tp_rank: int, tp_group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = SwiGLUMLP(hidden, intermediate, tp_size, tp_rank, tp_group)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: tuple[torch.Tensor, ...], meta: Any) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, kv_cache, meta)  # [T, hidden]
        return h + self.mlp(self.post_attention_layernorm(h))

    def load_hf(self, sd: "StateDictReader", prefix: str) -> None:
        load_norm(self.input_layernorm, sd, f"{prefix}.input_layernorm.weight")
        load_norm(self.post_attention_layernorm, sd, f"{prefix}.post_attention_layernorm.weight")
        self.self_attn.load_hf(sd, f"{prefix}.self_attn")
        self.mlp.load_hf(sd, f"{prefix}.mlp")


class CausalLM(nn.Module):
    """Embedding, decoder layers, final norm and lm_head (replicated) on one TP rank.

    Subclasses pass the attention module factory and the rotary dim; `cfg` needs
    vocab_size, hidden_size, num_layers, intermediate_size, rms_norm_eps, rope_theta
    and tie_word_embeddings.
    """

    def __init__(self, cfg: Any, tp_size: int, tp_rank: int, tp_group: dist.ProcessGroup | None,
                 make_attention: Callable[[], nn.Module], rotary_dim: int) -> None:
        super().__init__()
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank={tp_rank} outside tp_size={tp_size}")
        self.cfg = cfg
        self.tp_size = tp_size
        self.tp_rank = tp_rank
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary = RotaryEmbedding(rotary_dim, cfg.rope_theta)
        self.layers = nn.ModuleList(
            DecoderLayer(make_attention(), cfg.hidden_size, cfg.intermediate_size, cfg.rms_norm_eps, tp_size,
                         tp_rank, tp_group) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, ...]], meta: Any) -> torch.Tensor:
        """input_ids [T] int64, positions [T] int64 -> logits [T, vocab] fp32."""
        return self.logits(self.hidden_states(input_ids, positions, kv_caches, meta))

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      kv_caches: list[tuple[torch.Tensor, ...]], meta: Any) -> torch.Tensor:
        """The final-normed hidden states [T, hidden] (lm_head's input; an MTP layer's too)."""
        if not torch.compiler.is_compiling():
            # Eager: refuse bad metadata before the first layer writes its cache. A
            # compiled forward validates at its entry, outside the graph (decorator).
            # An eager forward runs the single-device ops: refused over a sharded cache.
            validate_step(meta, kv_caches, num_tokens=input_ids.shape[0], single_device_ops=True)
        h = self.embed_tokens(input_ids)  # [T, hidden]
        cos, sin = self.rotary(positions)  # [T, rotary_dim/2] each
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, kv_caches[i], meta)
        return self.norm(h)

    def logits(self, h: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, vocab] fp32
        w = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(h, w).float()

    def load_hf_state_dict(self, hf_state_dict: Mapping[str, torch.Tensor]) -> None:
        """Load an HF *ForCausalLM state dict, slicing this rank's TP shards (strict)."""
        sd = StateDictReader(hf_state_dict)
        load_replicated(self.embed_tokens.weight, sd.take("model.embed_tokens.weight"), "model.embed_tokens.weight")
        for i, layer in enumerate(self.layers):
            layer.load_hf(sd, f"model.layers.{i}")
        load_norm(self.norm, sd, "model.norm.weight")
        if self.lm_head is not None:
            load_replicated(self.lm_head.weight, sd.take("lm_head.weight"), "lm_head.weight")
        else:
            sd.get("lm_head.weight")  # tied: HF may or may not list it; it is the embedding
        # DeepSeek-V3 checkpoints append their MTP layers as model.layers.{num_layers}.*
        # (examples.models.deepseek_mtp loads them); the causal LM does not use them.
        sd.check_all_used(ignore_prefixes=(f"model.layers.{len(self.layers)}.",))


def load_hf_state_dict(model: CausalLM, hf_state_dict: Mapping[str, torch.Tensor],
                       tp_size: int | None = None, tp_rank: int | None = None) -> None:
    """Slice HF weights into `model` (built for its own tp_size / tp_rank)."""
    if (tp_size is not None and tp_size != model.tp_size) or (tp_rank is not None and tp_rank != model.tp_rank):
        raise ValueError(f"model was built for tp_size={model.tp_size}, tp_rank={model.tp_rank}; "
                         f"got tp_size={tp_size}, tp_rank={tp_rank}")
    model.load_hf_state_dict(hf_state_dict)
