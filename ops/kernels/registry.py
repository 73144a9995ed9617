"""Register the Triton kernels as the CUDA (and, with torch_npu, NPU) kernels of the cp::* ops.

CPU keeps the torch references, so a CPU `torch.compile` never traces into
Triton. Registration itself imports no triton: each kernel body fetches its
launcher on first call. Every `cp::` op gets an accelerator kernel: its device
kernel, or, when it has none (or triton is not installed), a kernel that raises
`MissingDeviceKernel` naming the op and the fix. A reference never serves an
accelerator silently: its Python loops and host reads cannot be captured in a
CUDA graph / aclgraph and would only look like they work.
"""

from __future__ import annotations

import torch

from cp_compile.ops import kernels, layout

_REGISTERED: list[str] = []


# Batches with at least this many tokens per request (prefill, chunked prefill) take the
# query-tiled kernel, which reads each request's pages once per BLOCK_M tokens instead
# of once per token; decode-like batches keep the per-token flash-decode kernel. A
# choice on shapes only (T and B are sizes), so a captured graph keeps one kernel.
PREFILL_TOKENS_PER_REQUEST = 4


def _paged(q, k_cache, v_cache, block_table, query_start_loc, kv_lens, scale):
    if q.shape[0] >= PREFILL_TOKENS_PER_REQUEST * max(query_start_loc.shape[0] - 1, 1):
        return kernels.paged_prefill_attention_lse_triton(q, k_cache, v_cache, block_table, query_start_loc,
                                                          kv_lens, scale)
    return kernels.paged_attention_with_lse_triton(q, k_cache, v_cache, block_table, query_start_loc, kv_lens, scale)


def _paged_attention_lse(q, k_cache, v_cache, block_table, query_start_loc, kv_lens, scale):
    return _paged(q, k_cache, v_cache, block_table, query_start_loc, kv_lens, scale)


def _mla_partial_attention(q_nope, q_pe, kv_cache, block_table, query_start_loc, kv_lens, scale):
    L = q_nope.shape[-1]
    return _paged(torch.cat([q_nope, q_pe], -1), kv_cache.unsqueeze(2), kv_cache[..., :L].unsqueeze(2), block_table,
                  query_start_loc, kv_lens, scale)


def _lse_rescale(out, lse, lse_all):
    T, G = lse.shape
    total = lse.new_empty(T, G)
    scaled = kernels.lse_rescale_triton(out, lse, lse_all.view(-1, G, T).permute(0, 2, 1), lse_out=total)
    return scaled, total


def _lse_combine(outs, lses):
    total = lses.new_empty(lses.shape[1:], dtype=torch.float32)
    return kernels.merge_partials_triton(outs, lses, lse_out=total), total


def _localize(slot_mapping, query_start_loc, seq_lens, dcp, rank, interleave, block_size):
    T = slot_mapping.shape[0]
    lay = dict(dcp=dcp, rank=rank, interleave=interleave)
    slots = kernels.local_slot_mapping_triton(slot_mapping.long(), **lay, block_size=block_size)
    return (slots, layout.local_len(seq_lens, **lay).to(torch.int32),
            layout.local_causal_lens(query_start_loc, seq_lens, T, **lay),
            layout.local_context_lens(query_start_loc, seq_lens, T, **lay))


def _gqa_paged_attention(q, k, v, k_cache, v_cache, slot_mapping, block_table, seq_lens, query_start_loc, scale):
    kernels.cache_write_triton(k, k_cache, slot_mapping)
    kernels.cache_write_triton(v, v_cache, slot_mapping)
    kv_lens = layout.causal_lens(query_start_loc, seq_lens, q.shape[0])
    return _paged_attention_lse(q, k_cache, v_cache, block_table, query_start_loc, kv_lens, scale)[0]


def _mla_attention(q_nope, q_pe, kv_c, k_pe, kv_cache, slot_mapping, block_table, seq_lens, query_start_loc, scale):
    kernels.cache_write_triton(torch.cat([kv_c, k_pe], -1), kv_cache, slot_mapping)
    kv_lens = layout.causal_lens(query_start_loc, seq_lens, q_nope.shape[0])
    return _mla_partial_attention(q_nope, q_pe, kv_cache, block_table, query_start_loc, kv_lens, scale)[0]


def _lazy(name: str):
    """The kernel launcher / device function `name` of cp_compile.ops.kernels, fetched
    (and triton imported) on first call, not at registration."""

    def call(*args, **kwargs):
        return getattr(kernels, name)(*args, **kwargs)

    call.__name__ = name
    return call


def _sparse_indices(topk_indices, dcp, rank, interleave, block_size):
    # Vectorised torch (a stable sort, gathers; no host read): runs as it is on the device.
    return layout.global_to_local_indices(topk_indices, dcp=dcp, rank=rank, interleave=interleave,
                                          block_size=block_size)


DEVICE_KERNELS = {
    "cp::paged_attention_lse": _paged_attention_lse,
    "cp::mla_partial_attention": _mla_partial_attention,
    "cp::lse_rescale": _lse_rescale,
    "cp::lse_combine": _lse_combine,
    "cp::dcp_localize_metadata": _localize,
    "cp::gqa_paged_attention": _gqa_paged_attention,
    "cp::mla_attention": _mla_attention,
    "cp::cache_write": _lazy("cache_write_device"),
    "cp::varlen_causal_attention_lse": _lazy("varlen_causal_attention_lse_device"),
    "cp::sparse_mla_attention": _lazy("sparse_mla_attention_device"),
    "cp::sparse_mla_partial_attention": _lazy("sparse_mla_partial_attention_device"),
    "cp::sparse_mla_rows_attention": _lazy("sparse_mla_rows_attention_device"),
    "cp::lightning_indexer": _lazy("lightning_indexer_device"),
    "cp::lightning_indexer_topk_rows": _lazy("lightning_indexer_topk_rows_device"),
    "cp::dcp_sparse_indices": _sparse_indices,
    "cp::w8a8_dynamic_linear": _lazy("w8a8_dynamic_linear_device"),
    "cp::w8a8_static_linear": _lazy("w8a8_static_linear_device"),
    "cp::mla_preprocess": _lazy("mla_preprocess_device"),
}


class MissingDeviceKernel(NotImplementedError):
    """A cp:: op was called on an accelerator that has no kernel for it."""


def refusing_kernel(op: str, device: str, reason: str, fix: str):
    """A kernel for `op` on `device` that raises `MissingDeviceKernel` (the op's name, why, the fix)."""

    def refuse(*args, **kwargs):
        raise MissingDeviceKernel(
            f"{op} has no {device} kernel: {reason}. The CPU torch reference is not used on an accelerator "
            f"(host reads, Python loops over requests). Fix: {fix}")

    refuse.__name__ = f"refuse_{op.replace('::', '_')}"
    return refuse


def cp_ops() -> list[str]:
    """Every op of the `cp` namespace defined so far ('cp::name')."""
    return sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith("cp::"))


def kernel_table(device: str, triton_ok: bool) -> dict[str, object]:
    """op -> the kernel registered for `device`: DEVICE_KERNELS' entry, or a refusal."""
    table = {}
    for op in cp_ops():
        if not triton_ok:
            table[op] = refusing_kernel(op, device, "triton is not installed",
                                        "install triton (pip install triton; triton-ascend on NPU), or run on CPU")
        elif op in DEVICE_KERNELS:
            table[op] = DEVICE_KERNELS[op]
        else:
            table[op] = refusing_kernel(op, device, "no device kernel is written for it",
                                        "add one to DEVICE_KERNELS (ops/kernels/registry.py), or run on CPU")
    return table


def device_types() -> list[str]:
    """Devices whose kernels are Triton: CUDA always, the NPU when torch_npu imports."""
    types = ["cuda"]
    try:
        import torch_npu  # noqa: F401  (renames PrivateUse1 to "npu")

        types.append("npu")
    except (ImportError, OSError, RuntimeError):  # not installed, or no Ascend driver libraries
        pass
    return types


def register_device_kernels() -> list[str]:
    """Idempotent; returns the '<op>@<device>' registrations made (refusals included)."""
    if _REGISTERED:
        return _REGISTERED
    triton_ok = kernels.triton_available()
    for device in device_types():
        for op, fn in kernel_table(device, triton_ok).items():
            torch.library.register_kernel(op, device, fn)
            _REGISTERED.append(f"{op}@{device}")
    return _REGISTERED
