"""Kernels the Triton-Ascend lowering check must reject (and one it must accept).

Kept outside the op families' triton_*.py so the product check never sees them;
tests/ops/test_ascend_lowering.py runs the check on this file and expects each
kernel to fail at the stage named in EXPECTED.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from cp_compile.ops.core.triton_common import CPU_MAX_PROGRAMS, LoweringDeclaration, kernel_for

BLOCK = 16

# kernel -> (stage it must fail at, text the failure must contain); None = must pass.
EXPECTED: dict[str, tuple[str, str] | None] = {
    "_vector_add_kernel": None,
    "_pointer_chase_kernel": ("linalg", ""),  # the adapter's own error
    "_tensor_descriptor_kernel": ("ttir", "make_tensor_descriptor"),
    "_atomic_add_kernel": ("rules", "atomics"),
    "_fp64_kernel": ("rules", "fp64"),
    "_grid_2d_kernel": ("rules", "1D persistent grid"),
    "_int64_offsets_kernel": ("rules", "int64"),
    "_fp16_sum_kernel": ("rules", "reduced in f16"),
    "_fp16_dot_kernel": ("rules", "tl.dot accumulates in f16"),
    "_oversized_grid_kernel": ("rules", "grid (64,)"),
    "_never_launched_kernel": ("declare", "no LOWERING example launches this kernel"),
}


@triton.jit
def _vector_add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    for b in range(pid, tl.cdiv(n, BLOCK), tl.num_programs(0)):
        offs = b * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) + tl.load(y_ptr + offs, mask=mask), mask=mask)


@triton.jit
def _oversized_grid_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    for b in range(pid, tl.cdiv(n, BLOCK), tl.num_programs(0)):
        offs = b * BLOCK + tl.arange(0, BLOCK)
        tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


@triton.jit
def _pointer_chase_kernel(table_ptr, out_ptr, n, BLOCK: tl.constexpr):
    # Addresses loaded from memory, then dereferenced (a gather through a pointer table).
    pid = tl.program_id(0)
    for b in range(pid, tl.cdiv(n, BLOCK), tl.num_programs(0)):
        offs = b * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        addr = tl.load(table_ptr + offs, mask=mask, other=0)
        src = addr.to(tl.pointer_type(tl.float32))
        tl.store(out_ptr + offs, tl.load(src, mask=mask), mask=mask)


@triton.jit
def _tensor_descriptor_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    desc = tl.make_tensor_descriptor(x_ptr, shape=[n], strides=[1], block_shape=[BLOCK])
    for b in range(pid, tl.cdiv(n, BLOCK), tl.num_programs(0)):
        offs = b * BLOCK + tl.arange(0, BLOCK)
        tl.store(out_ptr + offs, desc.load([b * BLOCK]), mask=offs < n)


@triton.jit
def _atomic_add_kernel(x_ptr, total_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    for b in range(pid, tl.cdiv(n, BLOCK), tl.num_programs(0)):
        offs = b * BLOCK + tl.arange(0, BLOCK)
        tl.atomic_add(total_ptr, tl.sum(tl.load(x_ptr + offs, mask=offs < n, other=0), axis=0))


@triton.jit
def _fp64_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    for b in range(pid, tl.cdiv(n, BLOCK), tl.num_programs(0)):
        offs = b * BLOCK + tl.arange(0, BLOCK)
        tl.store(out_ptr + offs, tl.load(x_ptr + offs))  # an unmasked fp64 copy (n % BLOCK == 0)


@triton.jit
def _grid_2d_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0) + tl.program_id(1) * tl.num_programs(0)
    for b in range(pid, tl.cdiv(n, BLOCK), tl.num_programs(0) * tl.num_programs(1)):
        offs = b * BLOCK + tl.arange(0, BLOCK)
        tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


@triton.jit
def _int64_offsets_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    for b in range(pid, tl.cdiv(n, BLOCK), tl.num_programs(0)):
        offs = (b * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
        tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


@triton.jit
def _fp16_sum_kernel(x_ptr, out_ptr, n_rows, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    for r in range(pid, n_rows, tl.num_programs(0)):
        x = tl.load(x_ptr + r * BLOCK + tl.arange(0, BLOCK))
        tl.store(out_ptr + r, tl.sum(x, axis=0))  # tl.sum upcasts bf16 but not fp16: an fp16 sum


@triton.jit
def _fp16_dot_kernel(a_ptr, b_ptr, out_ptr, n_tiles, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    tile = offs[:, None] * BLOCK + offs[None, :]
    for i in range(pid, n_tiles, tl.num_programs(0)):
        a = tl.load(a_ptr + i * BLOCK * BLOCK + tile)
        b = tl.load(b_ptr + i * BLOCK * BLOCK + tile)
        tl.store(out_ptr + i * BLOCK * BLOCK + tile, tl.dot(a, b, out_dtype=tl.float16))


@triton.jit
def _never_launched_kernel(x_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    for b in range(pid, tl.cdiv(n, BLOCK), tl.num_programs(0)):
        offs = b * BLOCK + tl.arange(0, BLOCK)
        tl.store(x_ptr + offs, 0.0, mask=offs < n)


def _launch(kernel, grid, *args) -> None:
    kernel_for(kernel, args[0].device)[grid](*args, BLOCK=BLOCK)


def _examples():
    f32 = torch.empty(64)
    yield "vector add", functools.partial(_launch, _vector_add_kernel, (4,), f32, f32, f32, 64)
    yield "grid too big", functools.partial(_launch, _oversized_grid_kernel, (2 * CPU_MAX_PROGRAMS,), f32, f32, 64)
    yield "pointer table", functools.partial(_launch, _pointer_chase_kernel, (4,), torch.empty(64, dtype=torch.int64),
                                             f32, 64)
    yield "descriptor", functools.partial(_launch, _tensor_descriptor_kernel, (4,), f32, f32, 64)
    yield "atomic", functools.partial(_launch, _atomic_add_kernel, (4,), torch.empty(64, dtype=torch.int64),
                                      torch.empty(1, dtype=torch.int64), 64)
    f64 = torch.empty(64, dtype=torch.float64)
    yield "fp64", functools.partial(_launch, _fp64_kernel, (4,), f64, f64, 64)
    yield "2d grid", functools.partial(_launch, _grid_2d_kernel, (2, 2), f32, f32, 64)
    yield "int64 offsets", functools.partial(_launch, _int64_offsets_kernel, (4,), f32, f32, 64)
    f16 = torch.empty(4, BLOCK, BLOCK, dtype=torch.float16)
    yield "fp16 sum", functools.partial(_launch, _fp16_sum_kernel, (4,), f16, f16, 4)
    yield "fp16 dot", functools.partial(_launch, _fp16_dot_kernel, (4,), f16, f16, f16, 4)


LOWERING = LoweringDeclaration(examples=_examples)
