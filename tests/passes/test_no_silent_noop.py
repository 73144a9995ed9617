"""No silent no-op (issue 19): a pass the config enabled that finds nothing to rewrite
says so. Under enable_dsa_cp the o_proj pass meeting row-parallel linears of which none
is the attention's o_proj (none reads an attention result, no role declared) is a
ConfigError asking for the role; before, it rewrote nothing and said nothing."""

from __future__ import annotations

import torch

import cp_compile
from cp_compile.base.config import AttentionSpec, ConfigError
from cp_compile.testing.multirank import run_on_ranks
from examples.models.common import RowParallelLinear


class NoAttention(torch.nn.Module):
    """A row-parallel linear on the input (an MLP down projection), no attention."""

    def __init__(self, tp: int, rank: int, group) -> None:
        super().__init__()
        self.down = RowParallelLinear(8, 4, tp, rank, tp_group=group)

    def forward(self, x: torch.Tensor, meta: cp_compile.AttentionMetadata) -> torch.Tensor:
        return self.down(x)


def _world(rank: int, world: int) -> str:
    cfg = cp_compile.CPConfig(tensor_parallel_size=world, block_size=4, enable_dsa_cp=True)
    state = cp_compile.init_parallel(cfg, device="cpu")
    m = NoAttention(world, state.layout.tp.rank, state.tp_group)
    compiled = cp_compile.compile_model(m, lowering="eager", dynamic_args=("x",),
                                        attention=AttentionSpec("sfa", num_heads=4, has_indexer=True))
    meta = cp_compile.build_attention_metadata([(0, 5)], cp_compile.BlockAllocator(4, 4))  # a prefill step
    try:
        with torch.no_grad():
            compiled(torch.randn(5, 8 // world), meta)
    except ConfigError as e:
        return str(e)
    finally:
        cp_compile.destroy_parallel()
    return "no error"


def test_o_proj_pass_finding_no_o_proj_under_dsa_cp_is_refused():
    for msg in run_on_ranks(_world, 2, timeout=300):
        assert "the o_proj pass finds the attention's o_proj under enable_dsa_cp" in msg, msg
        assert "o_proj='self_attn.o_proj'" in msg, msg


def test_validate_forward_args_finding_nothing_warns():
    """Before: no metadata or no caches in the forward's arguments -> nothing checked, nothing said."""
    import pytest

    from cp_compile.runtime.metadata_checks import validate_forward_args

    meta = cp_compile.build_attention_metadata([(0, 3)], cp_compile.BlockAllocator(4, 4))
    with pytest.warns(UserWarning, match=r"forward got no kv_caches argument .* is not checked"):
        validate_forward_args({"x": torch.zeros(3), "meta": meta})
    with pytest.warns(UserWarning, match=r"forward got no AttentionMetadata and kv_caches"):
        validate_forward_args({"x": torch.zeros(3)})
