"""Write a random HF checkpoint of any size, one safetensors shard at a time.

    write_random_checkpoint(config, "/tmp/big", max_shard_bytes=1 << 30)   # config: a transformers config

The tensor names and shapes are the model's own (`state_dict` of the model built on
the meta device, so nothing of model size is allocated). Shards are filled with
uniform noise scaled by 1 / sqrt(fan-in) (norm weights 1 + noise) and written with
`safetensors.torch.save_file`, then dropped: the writer's memory is one shard, never
the model. `model.safetensors.index.json` names each tensor's file, as
`save_pretrained` writes it. Tied lm_head weights are not written (as HF saves them).
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import torch


def _fill(name: str, shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    t = torch.empty(shape, dtype=torch.float32)
    if len(shape) == 1:
        t.uniform_(-0.1, 0.1, generator=gen)
        if name.endswith("norm.weight"):
            t += 1.0
    else:
        bound = 1.0 if "embed_tokens" in name else 1.0 / math.sqrt(shape[-1])
        t.uniform_(-bound, bound, generator=gen)
    return t.to(dtype)


def write_random_checkpoint(config: Any, path: str, max_shard_bytes: int = 1 << 30, seed: int = 0) -> int:
    """Write `config`'s model with random weights in `config.dtype` under `path`;
    returns the bytes of tensor data written."""
    from safetensors.torch import save_file

    from cp_compile.serving.hf.rank_load import build_meta_model, checkpoint_dtype

    dtype = checkpoint_dtype(config)
    model = build_meta_model(config, dtype)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    specs = [(n, tuple(t.shape), t.dtype)
             for n, t in model.state_dict().items() if not (tied and n == "lm_head.weight")]
    # Persistent buffers are part of the state dict too (e.g. a router bias); they are real, small.
    os.makedirs(path, exist_ok=True)
    shards: list[list[tuple[str, tuple[int, ...], torch.dtype]]] = [[]]
    size = 0
    for spec in specs:
        nbytes = math.prod(spec[1]) * dtype.itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes
    gen = torch.Generator().manual_seed(seed)
    weight_map: dict[str, str] = {}
    total = 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {n: _fill(n, s, dtype if d.is_floating_point else d, gen) for n, s, d in shard}
        save_file(tensors, os.path.join(path, fname), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update(dict.fromkeys(tensors, fname))
        del tensors
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    config.save_pretrained(path)
    return total
