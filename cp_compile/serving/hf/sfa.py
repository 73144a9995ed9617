"""DeepSeek-V3.2 / GLM-5 (`deepseek_v32`, `glm_moe_dsa`): HF's sparse MLA layers routed
to `cp::lightning_indexer` + `cp::sparse_mla_attention`.

HF's DSA attention builds a dense `[B, 1, S, T]` mask from the indexer's top-k and
needs HF's own cache (`update_indexer`), so the attention-function hook alone
cannot serve it. Each layer's `self_attn.forward` is replaced (per instance) by
`sfa_forward`, which runs the layer's own HF submodules (q_a_proj, q_a_layernorm,
q_b_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj, and the indexer's
wq_b, wk, k_norm, weights_proj) and HF's own rope functions from the model's module,
in HF's order, and makes the two cp op calls the SFA DCP pass (`passes/sfa_dcp.py`)
and the DSA-CP pass rewrite, like the example model `examples/models/deepseek_sfa.py`:

    q_I = wq_b(q_resid) [T, Hi, Di], k_I = k_norm(wk(x)) [T, Di], rope on the first R dims
    w   = weights_proj(x) * Hi^-0.5 * Di^-0.5            (HF's two scales folded: relu(c s) = c relu(s))
    topk = cp.lightning_indexer(q_I, k_I, w, index_cache, ...)   [T, K] request-local positions
    o   = W_UV cp.sparse_mla_attention(q_nope W_UK, q_pe, kv_c, k_pe, latent_cache, ..., topk) -> o_proj

Caches per layer: `(latent [NB, BS, L + R] sharded 1/dcp, index [NB, BS * dcp, Di]
replicated)`. GLM-5 layers with `indexer_types == "shared"` reuse the previous
layer's top-k: refused by `support.check_supported` (not built).
"""

from __future__ import annotations

import sys
import types
from typing import Any

import torch
from torch import nn

import cp_compile.ops  # noqa: F401  (registers torch.ops.cp.*)


def _rope_fns(attn: nn.Module) -> tuple[Any, Any]:
    """(main MLA rope, indexer rope) of the model's own module: both interleaved for
    GLM-5; DeepSeek-V3.2's indexer rotates halves (HF's `apply_rotary_pos_emb`)."""
    mod = sys.modules[type(attn).__module__]
    main = mod.apply_rotary_pos_emb_interleave
    if attn.config.model_type == "glm_moe_dsa":
        return main, mod.apply_rotary_pos_emb_interleave
    return main, mod.apply_rotary_pos_emb


def sfa_forward(self: nn.Module, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                attention_mask: torch.Tensor | None = None, cache: Any = None, position_ids: Any = None,
                prev_topk_indices: Any = None, **kwargs: Any) -> tuple[Any, ...]:
    try:
        # (latent, index) or, over a quantised latent (CPConfig.kv_cache_dtype), (latent, latent_scale, index)
        (latent_cache, *scales, index_cache), meta = kwargs["cp_kv_caches"][self.layer_idx], kwargs["cp_meta"]
    except KeyError as e:
        raise TypeError(f"cp_compile.serving.hf SFA attention needs model kwarg {e.args[0]!r}; call the model through "
                        "cp_compile.serving.hf.Engine") from None
    main_rope, index_rope = _rope_fns(self)
    B, S = hidden_states.shape[:2]  # B == 1: tokens are flattened
    nope, rope, vdim, lat = self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim, self.kv_lora_rank
    q_resid = self.q_a_layernorm(self.q_a_proj(hidden_states))  # [1, T, q_lora]
    q_states = self.q_b_proj(q_resid).view(B, S, -1, nope + rope).transpose(1, 2)  # [1, H, T, nope + R]
    q_pass, q_rot = torch.split(q_states, [nope, rope], dim=-1)
    kv_pass, k_rot = torch.split(self.kv_a_proj_with_mqa(hidden_states), [lat, rope], dim=-1)
    kv_c = self.kv_a_layernorm(kv_pass)  # [1, T, L]
    cos, sin = position_embeddings
    q_rot, k_rot = main_rope(q_rot, k_rot.view(B, 1, S, rope), cos, sin)  # [1, H, T, R], [1, 1, T, R]

    ix = self.indexer
    qi = ix.wq_b(q_resid).view(B, S, ix.n_heads, ix.head_dim)  # [1, T, Hi, Di]
    qi_rot, qi_pass = torch.split(qi, [ix.qk_rope_head_dim, ix.head_dim - ix.qk_rope_head_dim], dim=-1)
    ki = ix.k_norm(ix.wk(hidden_states)).unsqueeze(2)  # [1, T, 1, Di]
    ki_rot, ki_pass = torch.split(ki, [ix.qk_rope_head_dim, ix.head_dim - ix.qk_rope_head_dim], dim=-1)
    qi_rot, ki_rot = index_rope(qi_rot, ki_rot, cos, sin, unsqueeze_dim=2)
    qi = torch.cat([qi_rot, qi_pass], dim=-1)[0]  # [T, Hi, Di]
    ki = torch.cat([ki_rot, ki_pass], dim=-1)[0, :, 0]  # [T, Di]
    w = ix.weights_proj(hidden_states.to(ix.weights_proj.weight.dtype))[0] * (ix.n_heads ** -0.5 * ix.softmax_scale)
    topk = torch.ops.cp.lightning_indexer(qi.contiguous(), ki.contiguous(), w.to(qi.dtype).contiguous(), index_cache,
                                          meta.slot_mapping, meta.block_table, meta.seq_lens, meta.query_start_loc,
                                          ix.index_topk)  # [T, K] int32, -1 padded

    wkv = self.kv_b_proj.weight.view(-1, nope + vdim, lat)  # [H, nope + v, L] (this rank's heads)
    q_nope = q_pass[0].transpose(0, 1)  # [T, H, nope]
    q_abs = torch.einsum("thn,hnl->thl", q_nope, wkv[:, :nope])  # [T, H, L]
    q_pe = q_rot[0].transpose(0, 1)  # [T, H, R]
    lat_args = (q_abs.contiguous(), q_pe.contiguous(), kv_c[0].contiguous(), k_rot[0, 0].contiguous(), latent_cache)
    meta_args = (meta.slot_mapping, meta.block_table, meta.seq_lens, meta.query_start_loc, topk, self.scaling)
    if scales:  # the quantised latent's own op, its scale cache a required written argument (decision 69)
        o_lat = torch.ops.cp.sparse_mla_attention_quant(*lat_args, *scales, *meta_args)  # [T, H, L]
    else:
        o_lat = torch.ops.cp.sparse_mla_attention(*lat_args, *meta_args)  # [T, H, L]
    out = torch.einsum("thl,hvl->thv", o_lat, wkv[:, nope:])  # [T, H, v]
    # o_proj on [T, H * v] (2D): the DSA-CP o_proj pass matches the example models' 2D linear.
    out = self.o_proj(out.reshape(S, -1)).unsqueeze(0)  # [1, T, hidden]
    if hasattr(self, "skip_topk"):  # GLM-5 layers also hand their top-k to the next layer
        return out, None, topk
    return out, None


def route_sfa_layers(model: nn.Module) -> int:
    """Point every layer's attention at `sfa_forward`; returns how many."""
    n = 0
    for layer in model.model.layers:
        attn = layer.self_attn
        attn.forward = types.MethodType(sfa_forward, attn)
        n += 1
    return n
