"""The cache object handed to an HF model as `cache=`: it hands each layer's
new K/V (or MLA latent) to the attention function instead of storing it.

HF attention modules call `cache.update(k, v, layer_idx, kwargs=kwargs)` right
before the attention function and pass the same `kwargs` dict to it. The paged
cache tensors themselves arrive at the attention function as model kwargs
(`cp_kv_caches`, `cp_meta`); the custom op writes them. For MLA, HF expands the
latent into per-head K/V after `update`, so the latent is only visible here: we
put it into `kwargs` for the MLA attention function (the expansion is then dead
code the compiler drops).
"""

from __future__ import annotations

from typing import Any

import torch

MLA_NEW_KEY = "cp_mla_new"  # kwargs key: (kv_c [T, L], k_pe [T, R]) of this layer's new tokens


class PagedCache:
    """Stateless stand-in for HF's `Cache`: nothing is stored here (the paged
    tensors live in `KVCache.layers`, written by the cp ops), so one instance serves
    every step and the compiled graph does not depend on it."""

    is_compileable = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               kwargs: dict[str, Any] | None = None, cache_kwargs: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        # GQA: key/value [1, Hkv, T, D] flow on to the attention function as they are.
        # MLA: key_states = kv_c [1, 1, T, L], value_states = k_pe [1, 1, T, R].
        if kwargs is not None:
            kwargs[MLA_NEW_KEY] = (key_states, value_states)
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        # Only reached when position_ids is None; the engine always passes positions.
        raise RuntimeError("cp_compile.serving.hf.PagedCache: pass position_ids (flattened positions) to the model")
