"""The evaluator cases of tests/ops/test_ge_eval_lengths.py, run in the torchair
environment (the evaluator reads torchair's protobuf enums; that environment has no
pytest): `python -m tests.ops.ge_eval_length_cases` prints each case's outcome as JSON."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from tools.ge_eval.evaluator import Ctx

BS, NB, H, D = 4, 3, 2, 8
# One paged FIA call of one token whose request's row has 2 blocks of 4 (8 keys).
FIA_ATTRS = dict(num_heads=H, num_key_value_heads=1, input_layout="BSND", block_size=BS, sparse_mode=0,
                 scale=0.5, softmax_lse_flag=True)


def _ctx(op_type: str, names: list[str]) -> "Ctx":
    from tools.ge_eval.evaluator import Ctx, Findings

    return Ctx(f"{op_type}_0", op_type, names, Findings(), None, {}, [])


def _fia(kv_len: int) -> list:
    import torch

    from tools.ge_eval import cann_ops

    names = ["query", "key0", "value0", "actual_seq_lengths_kv", "block_table"]
    ins = [torch.randn(1, 1, H, D), torch.randn(NB, BS, D), torch.randn(NB, BS, D),
           torch.tensor([kv_len], dtype=torch.int64), torch.tensor([[2, 0]], dtype=torch.int32)]
    return cann_ops.fused_infer_attention_score(_ctx("FusedInferAttentionScore", names), ins, FIA_ATTRS)


def _sfa(kv_len: int) -> list:
    """SparseFlashAttention over one request of two tokens, `kv_len` keys, a 2-block row."""
    import torch

    from tools.ge_eval import cann_ops

    names = ["query", "key", "value", "sparse_indices", "block_table", "actual_seq_lengths_query",
             "actual_seq_lengths_kv"]
    cache = torch.randn(NB, BS, 1, D)
    ins = [torch.randn(2, H, D), cache, cache, torch.tensor([[[0, -1]], [[1, 0]]], dtype=torch.int32),
           torch.tensor([[1, 2]], dtype=torch.int32), torch.tensor([2], dtype=torch.int32),
           torch.tensor([kv_len], dtype=torch.int32)]
    attrs = dict(layout_query="TND", layout_kv="PA_BSND", sparse_mode=3, scale_value=0.5, attention_mode=2)
    return cann_ops.sparse_flash_attention(_ctx("SparseFlashAttention", names), ins, attrs)


def _crash() -> list:
    """An op function that raises a bare torch error, run through the evaluator."""
    import torch

    from tools.ge_eval.evaluator import PRIMITIVES, Evaluator

    PRIMITIVES["CpCheckCrash"] = lambda ctx, ins, a: [torch.arange(int(ins[0]))]  # arange(-1) raises
    o = SimpleNamespace(name="crash_0", type="CpCheckCrash", attr={}, output_desc=[], input=[])
    return Evaluator(SimpleNamespace(op=[]))._execute(o, [-1])


CASES: dict[str, Callable[[], list]] = {
    "fia 5": lambda: _fia(5), "fia -1": lambda: _fia(-1), "fia 9": lambda: _fia(9),
    "sfa 2": lambda: _sfa(2), "sfa -1": lambda: _sfa(-1), "sfa 9": lambda: _sfa(9),
    "crash": _crash,
}


def _outcomes() -> dict[str, str]:
    """{case: "ok" | "GEEvalError: message" | "OtherError: message"}."""
    from tools.ge_eval.evaluator import GEEvalError

    out = {}
    for name, case in CASES.items():
        try:
            case()
            out[name] = "ok"
        except GEEvalError as e:
            out[name] = f"GEEvalError: {e}"
        except Exception as e:  # noqa: BLE001 - a crash is the outcome the tests reject
            out[name] = f"{type(e).__name__}: {e}"
    return out


if __name__ == "__main__":
    from tools import torchair_standin

    torchair_standin.install()  # torchair (whose protobuf enums the evaluator reads) importable
    print(json.dumps(_outcomes()))
