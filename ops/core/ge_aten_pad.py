"""GE converter override: `aten.constant_pad_nd` with a symbolic pad amount.

torchair's own converter (torch-npu 2.13.0, `ge_converter/aten/constant_pad_nd.py`)
emits `PadV3(x, paddings=Const)` for a list of ints and raises NotImplementedError
when the list holds a SymInt (torchair then hands the whole pad list as one int
tensor). The DSA-CP prefill graph pads the token dim to tp * ceil(T / tp)
(`ops/parallel/dsa_cp.pad_tokens`, `F.pad`): the pad amount is a function of the
symbolic token count, so that graph did not lower to GE (issue 21).

This converter keeps torchair's for static pads and, for a tensor pad, builds
PadV3's `paddings` in-graph: torch's pad list runs from the last dim backwards,
(before, after) per dim; PadV3 (paddings_contiguous = true, CANN's PadV3 IR:
"[[begin0, end0], [begin1, end1], ...]") runs from dim 0 forwards. A GatherV2 of
[pad..., 0] with a static permutation reorders it, dims the pad list does not
name get 0. No data-dependent shape, no host read, and the FX graph is unchanged
(no new Dynamo guard: the F.pad form is kept exactly because `torch.cat` of zero
rows guarded on the pad being 0, a recompile per token-count parity).
"""

from __future__ import annotations

from typing import Any

import torch
from torchair._ge_concrete_graph import ge_apis as ge
from torchair.ge._ge_graph import Tensor

from cp_compile.ops.core.ge_util import I32, I64, cast, const


def padv3_order(rank: int, pad_len: int) -> list[int]:
    """Indices into [pad_0, ..., pad_{pad_len-1}, 0] giving PadV3's contiguous paddings
    (dim 0 first, (begin, end) per dim) for torch's pad list (last dim first)."""
    if pad_len % 2 or pad_len > 2 * rank:
        raise ValueError(f"constant_pad_nd: pad list of length {pad_len} for a rank-{rank} input; it must be "
                         f"even and at most {2 * rank}")
    order = []
    for d in range(rank):
        j = rank - 1 - d  # torch's pair index of dim d
        order += [2 * j, 2 * j + 1] if 2 * j < pad_len else [pad_len, pad_len]
    return order


def convert_constant_pad_nd(self: Tensor, pad: Any, value: Any = 0, meta_outputs: Any = None):
    if not isinstance(pad, Tensor):
        from torchair._ge_concrete_graph.ge_converter.aten.constant_pad_nd import \
            conveter_aten_constant_pad_nd_default  # torchair's (sic) converter for int pads

        return conveter_aten_constant_pad_nd_default(self, pad, value, meta_outputs)
    (pad_len,) = pad.symsize  # torchair packs the pad list into one int vector of static length
    padded = ge.ConcatV2([cast(pad, I64), const([0], I64)], const(0, I32), N=2)
    paddings = ge.GatherV2(padded, const(padv3_order(self.rank, int(pad_len)), I64), const(0, I64))
    return ge.PadV3(self, paddings, const(value, self.dtype), mode="constant", paddings_contiguous=True)


def register() -> None:
    import torchair

    torchair.register_fx_node_ge_converter(torch.ops.aten.constant_pad_nd.default)(convert_constant_pad_nd)
