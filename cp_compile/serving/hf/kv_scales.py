"""Static per-layer KV-cache scales from a checkpoint (issue 39, decision 71).

vLLM-style fp8 checkpoints carry one fp32 scalar per layer for the keys and one for the
values, named (vLLM `model_loader/weight_utils.py`, `maybe_remap_kv_scale_name`):

    model.layers.N.self_attn.k_scale / v_scale                  (compressed-tensors, the plain form)
    model.layers.N.self_attn.k_proj.k_scale / v_proj.v_scale    (NVIDIA ModelOpt)
    model.layers.N.self_attn.kv_scale                           (deprecated: one scale for both)

A scale is the dequantisation factor, as in our dynamic path: value = code * scale. So a
static scale replaces the dynamic `amax / qmax` of every row the layer writes; codes past
the dtype's range are clamped; the scale goes into the same per-token scale cache, so every
reader (decode, partial, chunked, DCP, P/D transfer) is unchanged.

What is used where (decision 71):
- `kv_cache_dtype="fp8_e4m3"`: the scales are used (they are calibrated for e4m3: amax / 448).
- `"int8"`: not used, the cache keeps its dynamic scales: an fp8-calibrated scale would clip
  int8 at 127 / 448 of the calibrated range. `"auto"`: no quantised cache, nothing to scale.
- MLA: the latent `[c | k_pe]` has one scale per token; the layer's `k_scale` is used for it
  (vLLM's MLA writes the latent with `k_scale` and ignores `v_scale`).
- SFA: refused with any quantised cache (docs/quant_kv.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
import torch
from torch import nn

from cp_compile.base.errors import ConfigError
from cp_compile.serving.hf.checkpoint import Checkpoint

# The quant ops' keyword -> the attention module attribute holding the layer's scale.
STATIC_SCALE_ATTRS = {"k_static_scale": "cp_k_static_scale", "v_static_scale": "cp_v_static_scale",
                      "kv_static_scale": "cp_kv_static_scale"}

# (k name, v name) per layer, in the order they are looked for.
_FORMS = (("self_attn.k_scale", "self_attn.v_scale"), ("self_attn.k_proj.k_scale", "self_attn.v_proj.v_scale"),
          ("self_attn.kv_scale", "self_attn.kv_scale"))


@dataclass(frozen=True)
class KVScales:
    """One layer's static scales (fp32 scalars) and the checkpoint names they came from."""

    k: float
    v: float
    k_name: str
    v_name: str


def check_scale(name: str, value: torch.Tensor) -> float:
    """One positive, finite scalar, or ConfigError naming the tensor and the fix."""
    fix = ("re-export the checkpoint's KV scales as one positive fp32 scalar per layer (amax / 448 for fp8_e4m3), "
           "or remove the tensor to use dynamic per-token scales")
    if value.numel() != 1 or value.dim() > 1:
        raise ConfigError("a checkpoint KV scale is one scalar per layer (shape [] or [1])",
                          f"{name}: shape {list(value.shape)}", fix)
    x = float(value.reshape(()).float())
    if not math.isfinite(x) or x <= 0:
        raise ConfigError("a checkpoint KV scale is positive and finite", f"{name} = {x!r}", fix)
    return x


def read_kv_scales(path: str, num_layers: int) -> dict[int, KVScales]:
    """The static scales of every layer in the safetensors checkpoint at `path` ({} if it
    has none). All layers or none: a checkpoint with some layers' scales is refused."""
    ckpt = Checkpoint(path)
    found: dict[int, KVScales] = {}
    for i in range(num_layers):
        for k_leaf, v_leaf in _FORMS:
            k_name, v_name = f"model.layers.{i}.{k_leaf}", f"model.layers.{i}.{v_leaf}"
            if k_name in ckpt or v_name in ckpt:
                for n in (k_name, v_name):
                    if n not in ckpt:
                        raise ConfigError("a checkpoint with KV scales has both k_scale and v_scale per layer",
                                          f"{path}: {k_name if n == v_name else v_name} present, {n} missing",
                                          "add the missing scale, or remove both to use dynamic scales")
                k = check_scale(k_name, ckpt.read(k_name))
                v = check_scale(v_name, ckpt.read(v_name))
                found[i] = KVScales(k, v, k_name, v_name)
                break
    if found and len(found) != num_layers:
        missing = [i for i in range(num_layers) if i not in found]
        raise ConfigError("a checkpoint with KV scales has them for every layer",
                          f"{path}: layers {missing} have no k_scale / v_scale ({len(found)} of {num_layers} do)",
                          "export the scales of every layer, or none (dynamic per-token scales)")
    return found


def attach(model: nn.Module, scales: dict[int, KVScales], kind: str, kv_cache_dtype: str) -> str | None:
    """Put each layer's static scales on its attention module (fp32 [] buffers, on the
    model's device) where they are used (module doc); returns the start-up line saying
    what was done with the checkpoint's scales (None when it has none)."""
    if not scales:
        return None
    if kind not in ("gqa", "mla"):
        raise ConfigError("checkpoint KV scales are for GQA and MLA models", f"attention kind={kind!r} with "
                          f"{len(scales)} layers of k_scale / v_scale", "set kv_cache_dtype='auto' for SFA models")
    if kv_cache_dtype != "fp8_e4m3":
        return (f"KV cache scales: the checkpoint's static k_scale / v_scale ({len(scales)} layers) are not used: "
                f"kv_cache_dtype={kv_cache_dtype!r} " + ("stores the model's dtype" if kv_cache_dtype == "auto" else
                                                         "keeps dynamic per-token scales (the checkpoint's are "
                                                         "calibrated for fp8_e4m3)"))
    device = next(model.parameters()).device
    for i, layer in enumerate(model.model.layers):
        attn, s = layer.self_attn, scales[i]
        for attr in STATIC_SCALE_ATTRS.values():  # a re-attach replaces, never mixes
            if hasattr(attn, attr):
                delattr(attn, attr)
        if kind == "mla":  # one scale per token for [c | k_pe]: the key scale (vLLM's MLA)
            attn.register_buffer(STATIC_SCALE_ATTRS["kv_static_scale"],
                                 torch.tensor(s.k, dtype=torch.float32, device=device), persistent=False)
        else:
            attn.register_buffer(STATIC_SCALE_ATTRS["k_static_scale"],
                                 torch.tensor(s.k, dtype=torch.float32, device=device), persistent=False)
            attn.register_buffer(STATIC_SCALE_ATTRS["v_static_scale"],
                                 torch.tensor(s.v, dtype=torch.float32, device=device), persistent=False)
    return (f"KV cache scales: static per-layer {'k_scale (the MLA latent)' if kind == 'mla' else 'k_scale / v_scale'}"
            f" from the checkpoint, {len(scales)} layers (fp8_e4m3)")


def scales_of(model: nn.Module) -> dict[int, dict[str, float]]:
    """The static scales attached to each layer (for reports and tests)."""
    out: dict[int, dict[str, float]] = {}
    for i, layer in enumerate(getattr(getattr(model, "model", None), "layers", [])):
        got = {k: float(getattr(layer.self_attn, a)) for k, a in STATIC_SCALE_ATTRS.items()
               if getattr(layer.self_attn, a, None) is not None}
        if got:
            out[i] = got
    return out

