"""A kernel whose CUDA compile fails: tl.dot of an int8 tile with an fp32 tile
(Triton rejects mixed operand types). The launch is only captured, never run, so
it shows the AOT check failing on a compile error (tests/ops/test_device_check.py)."""

import functools

import torch
import triton
import triton.language as tl

from cp_compile.ops.core.triton_common import LoweringDeclaration, kernel_for


@triton.jit
def _mixed_dot_kernel(a_ptr, b_ptr, out_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    a = tl.load(a_ptr + offs[:, None] * BLOCK + offs[None, :])
    b = tl.load(b_ptr + offs[:, None] * BLOCK + offs[None, :])
    tl.store(out_ptr + offs[:, None] * BLOCK + offs[None, :], tl.dot(a, b))


def mixed_dot(a: torch.Tensor, b: torch.Tensor) -> None:
    kernel_for(_mixed_dot_kernel, a.device)[(1,)](a, b, torch.empty_like(b), BLOCK=a.shape[0])


LOWERING = LoweringDeclaration(examples=lambda: [
    ("int8 x fp32 dot", functools.partial(mixed_dot, torch.empty(16, 16, dtype=torch.int8), torch.empty(16, 16)))])
