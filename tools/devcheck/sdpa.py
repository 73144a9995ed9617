"""torch SDPA on contiguous KV with a pinned backend, recorded (the side-by-side baseline).

Flash first; a shape flash refuses (MLA's 576-wide keys: flash takes head dims <= 256)
runs the next backend that accepts it, and the row names which one ran and why."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

ORDER = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)


def pinned_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool = False):
    """-> (a zero-argument call running SDPA with the first backend that accepts these
    inputs, its name, the refusals before it)."""
    refusals = []
    for backend in ORDER:
        def call(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, scale=scale, is_causal=causal)
        try:
            call()
        except RuntimeError as exc:
            refusals.append(f"{backend.name}: {str(exc).splitlines()[0][:160]}")
            continue
        return call, backend.name, refusals
    raise RuntimeError("no SDPA backend accepts these inputs: " + " | ".join(refusals))
