"""Rank-local loading: each TP rank reads only its shard of an HF checkpoint.

    model = load_rank_local(path, tp=4, tp_rank=r, tp_group=state.tp_group)  # after init_parallel
    engine = cp_compile.serving.hf.Engine(model, cfg, ...)                    # sees it is sharded already

1. The model is built from `config.json` with every parameter on the meta device (no
   bytes); buffers are real (the RoPE tables are computed, not loaded).
2. The project's TP plan (`tp.shard_model`, `moe.py`) runs on the meta model, exactly as
   it runs on a loaded one, and tags each sharded parameter with the checkpoint
   entries it keeps (`selection.py`).
3. Each parameter is read from the safetensors files (`checkpoint.py`): a sharded one
   as memory-mapped slices of its rows / columns / experts' rows, a replicated one
   whole. MoE experts stored per expert (`experts.{e}.gate_proj.weight`, what
   `save_pretrained` writes) are read per expert and stacked into HF's fused
   `gate_up_proj [E, 2I/tp, H]` / `down_proj [E, H, I/tp]`; a fused checkpoint is sliced
   directly. Tied embeddings are materialised once and shared.

Peak host memory per rank: its shard + the replicated parts + one tensor's slice in
flight, never the whole checkpoint (tests/hf/test_rank_load_memory.py measures it).

The serving dtype defaults to the checkpoint's `torch_dtype`; parameters HF keeps in
fp32 at bf16 / fp16 (`_keep_in_fp32_modules_strict`, e.g. DeepSeek's router) stay fp32,
as `from_pretrained` keeps them. Quantised checkpoints (`quantization_config`) are
refused: the HF engine serves float weights only (W8A8 lives in the example models).
Why not transformers' own `tp_plan` loading: docs/decisions.md 63.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn

from cp_compile.base.errors import ConfigError
from cp_compile.serving.hf.checkpoint import Checkpoint
from cp_compile.serving.hf.moe import AllReduceOutput
from cp_compile.serving.hf.selection import selection_of
from cp_compile.serving.hf.support import check_supported
from cp_compile.serving.hf.tp import shard_model

_FLOAT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def checkpoint_dtype(config: Any) -> torch.dtype:
    """The checkpoint's `torch_dtype` (config.json's `dtype` / `torch_dtype`), fp32 if unset."""
    d = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(d, torch.dtype):
        return d
    if d is None or d == "auto":
        return torch.float32
    try:
        return _FLOAT_DTYPES[str(d).removeprefix("torch.")]
    except KeyError:
        raise ConfigError("a float checkpoint dtype", f"config.json dtype={d!r}",
                          f"serve a checkpoint saved in one of {sorted(_FLOAT_DTYPES)}") from None


@contextlib.contextmanager
def _params_on_meta() -> Iterator[None]:
    """While building a module: every parameter registered goes to the meta device
    (buffers stay real). Construction allocates each weight with `torch.empty`, whose
    pages are never touched under `no_init_weights`, then drops it."""
    orig = nn.Module.register_parameter

    def register(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        orig(self, name, param)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = orig  # type: ignore[method-assign]


def build_meta_model(config: Any, dtype: torch.dtype) -> nn.Module:
    """The HF `*ForCausalLM` of `config` with its parameters on the meta device."""
    import transformers
    from transformers.initialization import no_init_weights

    with _params_on_meta(), no_init_weights():
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
        model.tie_weights()  # tied embeddings: one meta parameter, loaded once, shared (`materialise`)
    return model.eval()


def _checkpoint_name(name: str, wrapped: tuple[str, ...]) -> str:
    """The checkpoint's name for model tensor `name`: the MoE wrapper (`AllReduceOutput`,
    attribute `block`) is not in the checkpoint."""
    for prefix in wrapped:
        if name.startswith(prefix + ".block."):
            return prefix + name[len(prefix) + len(".block"):]
    return name


def _read_experts(ckpt: Checkpoint, name: str, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """HF's fused expert tensor `name` (`...experts.gate_up_proj` [E, 2I, H] or
    `...experts.down_proj` [E, H, I]; this rank's part as tagged) from a checkpoint
    that stores each expert's `gate_proj` / `up_proj` / `down_proj` separately."""
    prefix, what = name.rsplit(".", 1)
    sel = selection_of(like)
    n_experts = like.shape[0]
    out = []
    for e in range(n_experts):
        if what == "gate_up_proj":
            inter = ckpt.shape(f"{prefix}.{e}.gate_proj.weight")[0]
            rows = sel[1] if sel is not None else torch.arange(2 * inter)
            gate, up = rows[rows < inter], rows[rows >= inter] - inter
            # [gate; up] rows: this rank's gate rows then its up rows (moe._shard_experts' order)
            out.append(torch.cat([ckpt.read(f"{prefix}.{e}.gate_proj.weight", 0, gate, dtype),
                                  ckpt.read(f"{prefix}.{e}.up_proj.weight", 0, up, dtype)]))
        elif what == "down_proj":
            key = f"{prefix}.{e}.down_proj.weight"  # [H, I]: columns are the intermediate dim
            out.append(ckpt.read(key, 1, sel[1], dtype) if sel is not None else ckpt.read(key, dtype=dtype))
        else:
            raise ConfigError("HF fused experts named gate_up_proj / down_proj", f"model tensor {name!r}",
                              "serve a DeepSeek-V2/V3/V3.2, GLM-5 or Qwen3-MoE checkpoint")
    return torch.stack(out)  # [E, ...]


def _fp32_names(model: nn.Module, dtype: torch.dtype) -> tuple[str, ...]:
    """Name fragments of the tensors HF's `from_pretrained` keeps in fp32 at this dtype."""
    keep = []
    if dtype in (torch.float16, torch.bfloat16):
        keep += list(getattr(model, "_keep_in_fp32_modules_strict", None) or [])
    if dtype == torch.float16:
        keep += list(getattr(model, "_keep_in_fp32_modules", None) or [])
    return tuple(keep)


def materialise(model: nn.Module, ckpt: Checkpoint, dtype: torch.dtype) -> int:
    """Replace every meta parameter of `model` (sharded or not) with its entries read
    from `ckpt`, and load the persistent buffers; returns the bytes materialised."""
    wrapped = tuple(n for n, m in model.named_modules() if isinstance(m, AllReduceOutput))
    fp32 = _fp32_names(model, dtype)
    done: dict[int, nn.Parameter] = {}  # id(meta parameter) -> its loaded one (tied weights share it)
    total = 0
    for name, param in list(model.named_parameters(remove_duplicate=False)):
        owner, leaf = _owner(model, name)
        if id(param) in done:
            setattr(owner, leaf, done[id(param)])
            continue
        src = _checkpoint_name(name, wrapped)
        want = torch.float32 if any(f in name for f in fp32) else dtype
        sel = selection_of(param)
        if src not in ckpt and src.rsplit(".", 1)[-1] in ("gate_up_proj", "down_proj") and param.dim() == 3:
            value = _read_experts(ckpt, src, param, want)
        elif sel is not None:
            value = ckpt.read(src, sel[0], sel[1], want)
        else:
            value = ckpt.read(src, dtype=want)
        if tuple(value.shape) != tuple(param.shape):
            raise ConfigError("checkpoint tensor shapes match config.json", f"{src}: read {tuple(value.shape)}, the "
                              f"model (this rank's shard) needs {tuple(param.shape)}",
                              "serve the checkpoint with the config.json it was saved with")
        new = nn.Parameter(value, requires_grad=False)
        done[id(param)] = new
        setattr(owner, leaf, new)
        total += value.numel() * value.element_size()
    for name, buf in list(model.named_buffers()):
        owner, leaf = _owner(model, name)
        if leaf in owner._non_persistent_buffers_set:
            continue  # computed at construction (RoPE tables), not saved
        src = _checkpoint_name(name, wrapped)
        value = ckpt.read(src, dtype=torch.float32 if any(f in name for f in fp32) else buf.dtype)
        owner._buffers[leaf] = value.reshape(buf.shape)
        total += value.numel() * value.element_size()
    return total


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, leaf = name.rpartition(".")
    return (model.get_submodule(path) if path else model), leaf


def load_rank_local(path: str, tp: int = 1, tp_rank: int = 0, tp_group: dist.ProcessGroup | None = None,
                    dtype: torch.dtype | None = None) -> nn.Module:
    """This TP rank's shard of the HF checkpoint at `path` (see module doc); `dtype`
    None: the checkpoint's. `tp_group`: init_parallel's TP group (tp > 1)."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(path)
    quant = getattr(config, "quantization_config", None)
    if quant is not None:
        method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", quant)
        raise ConfigError("a float checkpoint (cp_compile.serving.hf serves unquantised weights)",
                          f"{path}: quantization_config quant_method={method!r}",
                          "serve the bf16 / fp32 checkpoint (W8A8 runs in the example models: examples.models.quant)")
    check_supported(config)
    dtype = dtype or checkpoint_dtype(config)
    model = build_meta_model(config, dtype)
    shard_model(model, tp, tp_rank, tp_group)  # tags what each parameter keeps
    model.cp_loaded_bytes = materialise(model, Checkpoint(path), dtype)
    if os.path.exists(os.path.join(path, "generation_config.json")):
        model.generation_config = transformers.GenerationConfig.from_pretrained(path)
    return model
