"""Eager DSA-CP o_proj path: switch each o_proj to gathered full weights for a forward.

The graph pass (`passes/o_proj_dsa_cp.py`) rewrites compiled prefill graphs; this is
the same mechanism for an eager model, vLLM-Ascend style (its `tp_weight_switch`,
restored in try/finally since #13946):

    fw = OProjFullWeight(model)                 # once: finds the o_proj modules, owns the buffer pool
    with fw.for_step(meta):                     # prefill / mixed: full weight; decode: a no-op
        logits = model(input_ids, positions, caches, meta)

Inside the `with`, each o_proj module's forward is replaced by the full-weight
path of `cp_compile.ops.parallel.o_proj`: all-gather the TP shard of every input-sharded
parameter into a pooled buffer, point the module's parameters at the full buffers
(`param.set_`), run the full-weight linear on this rank's token shard (token
all-to-all in, output all-gather back), and point the parameters back at their TP
storage before returning — in a `finally`, so an exception in the middle of a
layer restores them too. Leaving the `with` (normally or by an exception) restores
every parameter again and removes the forward override.

Storage invariant: the TP-sharded parameter stays the only persistent copy of the
weights. The TP aliases (`param.detach()`) share its storage; the pool holds one
buffer per (parameter name, full shape, dtype, device), shared by every layer and
reused every step, so its size does not grow with the number of layers. The
unquantised weight [out, in/tp] is gathered as its transpose (the input shard is a
transient copy made per call, freed after the gather; vLLM-Ascend keeps a
persistent transposed copy per layer instead).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import Tensor, nn

from cp_compile.base.config import ConfigError
from cp_compile.passes.context import resolve_roles
from cp_compile.runtime.metadata import AttentionMetadata, batch_kind
from cp_compile.ops.parallel.dsa_cp import DSACPContext
from cp_compile.ops.parallel.o_proj import INPUT_SHARDED, full_linear, gather_tokens, shard_tokens
from cp_compile.base.parallel_layout import Group


def linear_kind(module: nn.Module) -> str:
    """"linear" for a float row-parallel linear, "w8a8_dynamic" / "w8a8_static" for W8A8 ones."""
    kind = getattr(module, "kind", "linear")
    if kind not in INPUT_SHARDED:
        raise ConfigError("the o_proj is a row-parallel linear the full-weight path knows",
                          f"{type(module).__name__} with kind={kind!r}",
                          f"use a module of kind {sorted(INPUT_SHARDED)} (examples.models.common.RowParallelLinear, "
                          "examples.models.quant.W8A8RowParallelLinear)")
    return kind


class OProjFullWeight:
    """The eager full-weight o_proj switch for every o_proj of `model` (module docstring)."""

    def __init__(self, model: nn.Module, o_proj: str = "self_attn.o_proj") -> None:
        (binding,) = resolve_roles(model, {"o_proj": o_proj})
        self.modules: list[nn.Module] = [model.get_submodule(n) for n in binding.modules]
        self.names = binding.modules
        groups = {id(getattr(m, "tp_group", None)) for m in self.modules}
        m0 = self.modules[0]
        tp, group = getattr(m0, "tp_size", 1), getattr(m0, "tp_group", None)
        if tp < 2 or group is None or len(groups) != 1:
            raise ConfigError("the full-weight o_proj needs TP-sharded o_projs on one TP group",
                              f"{o_proj!r}: tp_size={tp}, tp_group={group}, {len(groups)} distinct groups",
                              "build the model with tensor_parallel_size > 1 and its TP process group")
        self.kinds = [linear_kind(m) for m in self.modules]
        self.group: dist.ProcessGroup = group
        self.ctx = DSACPContext(tp=Group(tp, dist.get_rank(group), group.group_name))  # the model's TP group
        self.pool: dict[tuple[Any, ...], Tensor] = {}
        # Per module: parameter name -> alias of its TP storage (shares the storage).
        self._aliases: list[dict[str, Tensor]] = []

    # ------------------------------------------------------------------ switching

    @contextlib.contextmanager
    def for_step(self, meta: AttentionMetadata | None = None) -> Iterator["OProjFullWeight"]:
        """Full-weight o_projs for one forward; a no-op for decode-only batches
        (`metadata.batch_kind`), which keep the row-parallel TP path."""
        if meta is not None and batch_kind(meta) == "decode":
            yield self
            return
        self._install()
        try:
            yield self
        finally:
            self._uninstall()

    def _install(self) -> None:
        if self._aliases:
            raise RuntimeError("OProjFullWeight: already switched; nest no `with fw.for_step(...)` blocks")
        for m, kind in zip(self.modules, self.kinds):
            self._aliases.append({name: getattr(m, name).detach() for name, _ in INPUT_SHARDED[kind]})
            m.forward = self._make_forward(len(self._aliases) - 1)  # instance attribute: shadows the class's

    def _uninstall(self) -> None:
        try:
            for i, m in enumerate(self.modules[:len(self._aliases)]):
                self._restore(i)
                m.__dict__.pop("forward", None)
        finally:
            self._aliases = []

    def _restore(self, i: int) -> None:
        m = self.modules[i]
        with torch.no_grad():
            for name, alias in self._aliases[i].items():
                getattr(m, name).set_(alias)

    def _buffer(self, name: str, shape: tuple[int, ...], like: Tensor) -> Tensor:
        key = (name, shape, like.dtype, like.device)
        buf = self.pool.get(key)
        if buf is None:
            buf = self.pool[key] = torch.empty(shape, dtype=like.dtype, device=like.device)
        return buf

    def _make_forward(self, i: int):
        def forward(x: Tensor) -> Tensor:
            return self._full_weight_forward(i, x)
        return forward

    def _full_weight_forward(self, i: int, x: Tensor) -> Tensor:  # x [T, in/tp] -> [T, out]
        m, kind, aliases, tp = self.modules[i], self.kinds[i], self._aliases[i], self.ctx.tp.size
        full: dict[str, Tensor] = {}
        for name, _ in INPUT_SHARDED[kind]:
            # The float weight [out, in/tp] is gathered as its transpose [in/tp, out]
            # (dim 0); the int8 weight and W8A8 group parameters are split on dim 0.
            src = aliases[name].t().contiguous() if kind == "linear" else aliases[name].contiguous()
            buf = self._buffer(name, (tp * src.shape[0], *src.shape[1:]), src)
            dist.all_gather_into_tensor(buf, src, group=self.group)
            full[name] = buf.t() if kind == "linear" else buf  # the parameter's full shape
        try:
            with torch.no_grad():
                for name, t in full.items():
                    getattr(m, name).set_(t)  # the module now holds the full weights
            params = {n: p for n, p in m.named_parameters(recurse=False) if n != "bias"}
            if kind == "linear":
                params = {"weight_t": m.weight.t()}  # [in, out]: the pooled buffer itself
            y_rows = full_linear(kind, shard_tokens(x, self.ctx), params, getattr(m, "local_groups", 1) * tp)
        finally:
            self._restore(i)  # back to the TP aliases, also when the layer raised
        y = gather_tokens(y_rows, self.ctx, x.shape[0])  # [T, out]
        if getattr(m, "bias", None) is not None:
            y = y + m.bias
        return y

    def pool_bytes(self) -> int:
        """Bytes held by the full-weight buffers (one per name, shape, dtype, device)."""
        return sum(t.numel() * t.element_size() for t in self.pool.values())
