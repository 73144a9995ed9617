"""Reading parts of a safetensors checkpoint directory without reading whole tensors.

A directory holds `model.safetensors`, or shards named by `model.safetensors.index.json`
(`weight_map`: tensor name -> file). `Checkpoint.read(name, dim, index)` returns the
entries `index` of `name` along `dim`: each contiguous run of `index` is one
memory-mapped slice (`safe_open(...).get_slice(name)[..., a:b]`), copied out into
owned contiguous memory; the slice views (and with them the file's mapping) are
dropped after the read. Only the pages holding the slice are read: all of a row
slice's, and for a column slice (a row-parallel weight) the pages its row chunks
fall in, at most that one tensor's pages, mapped only during its read.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from cp_compile.base.errors import ConfigError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def _runs(index: torch.Tensor) -> list[tuple[int, int]]:
    """`index` (1-D ints) as [start, stop) runs of consecutive values, in order."""
    vals = index.tolist()
    runs: list[tuple[int, int]] = []
    for v in vals:
        if runs and runs[-1][1] == v:
            runs[-1] = (runs[-1][0], v + 1)
        else:
            runs.append((v, v + 1))
    return runs


class Checkpoint:
    """The safetensors files of one HF checkpoint directory (see module doc)."""

    def __init__(self, path: str) -> None:
        self.path = path
        index = os.path.join(path, INDEX_FILE)
        if os.path.exists(index):
            with open(index) as f:
                self.weight_map: dict[str, str] = dict(json.load(f)["weight_map"])
        elif os.path.exists(os.path.join(path, SINGLE_FILE)):
            from safetensors import safe_open

            with safe_open(os.path.join(path, SINGLE_FILE), framework="pt") as f:
                self.weight_map = dict.fromkeys(f.keys(), SINGLE_FILE)
        else:
            raise ConfigError("a safetensors checkpoint directory", f"{path!r} has neither {INDEX_FILE} nor "
                                f"{SINGLE_FILE}", "save the model with save_pretrained(path) (safetensors, "
                                "the default) or point at the directory holding the .safetensors files")

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def _file(self, name: str) -> str:
        try:
            return os.path.join(self.path, self.weight_map[name])
        except KeyError:
            raise ConfigError("every model tensor in the checkpoint", f"{name!r} missing from {self.path}",
                                "use a checkpoint written by save_pretrained for this config (the tensor names "
                                "must match the model's)") from None

    def shape(self, name: str) -> list[int]:
        from safetensors import safe_open

        with safe_open(self._file(name), framework="pt") as f:
            return list(f.get_slice(name).get_shape())

    def read(self, name: str, dim: int | None = None, index: torch.Tensor | None = None,
             dtype: torch.dtype | None = None) -> torch.Tensor:
        """Entries `index` of tensor `name` along `dim` (all of it when `index` is None),
        cast to `dtype`; each contiguous run of `index` is one mapped slice."""
        from safetensors import safe_open

        with safe_open(self._file(name), framework="pt") as f:
            sl = f.get_slice(name)
            if index is None and not sl.get_shape():  # a scalar (a KV scale): no slice of a 0-dim tensor
                parts = [f.get_tensor(name)]
            elif index is None:
                parts = [sl[:]]
            else:
                lead: tuple[Any, ...] = (slice(None),) * dim
                parts = [sl[lead + (slice(a, b),)] for a, b in _runs(index)]
            want = dtype or parts[0].dtype
            # The slices are views of the file's mapping: copy them out (contiguous, owned
            # memory), so the mapping goes when they do and only this shard stays resident.
            if len(parts) == 1:
                return parts[0].to(dtype=want, memory_format=torch.contiguous_format, copy=True)
            return torch.cat(parts, dim=dim or 0).to(want)
