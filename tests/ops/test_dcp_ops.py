"""The DCP building-block ops on their own: opcheck, empty-shard contract, device registration."""

import pytest
import torch

import cp_compile.ops  # noqa: F401
from cp_compile.ops.core import layout
from cp_compile.ops.core import launcher
from cp_compile.ops.core.registry import DEVICE_KERNELS, register_device_kernels

cp = torch.ops.cp


def _meta():
    qsl = torch.tensor([0, 3, 4, 6], dtype=torch.int32)
    seq = torch.tensor([3, 9, 2], dtype=torch.int32)
    slots = torch.tensor([0, 1, 2, 40, 16, 17, -1, -1], dtype=torch.int64)
    bt = torch.tensor([[0, 3], [5, 4], [2, 1]], dtype=torch.int32)
    return qsl, seq, slots, bt


def test_opcheck_building_blocks():
    qsl, seq, slots, bt = _meta()
    T = slots.shape[0]
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    kv_lens = torch.tensor([1, 2, 0, 3, 1, 1, 0, 0], dtype=torch.int32)
    lse = r(T, 4)
    lse[2] = float("-inf")
    torch.library.opcheck(cp.dcp_localize_metadata, (slots, qsl, seq, 2, 1, 2, 4))
    torch.library.opcheck(cp.cache_write, (r(T, 1, 8), torch.zeros(8, 4, 1, 8), slots.clamp(max=31)))
    torch.library.opcheck(cp.paged_attention_lse, (r(T, 4, 8), r(8, 4, 1, 8), r(8, 4, 1, 6), bt, qsl, kv_lens, 0.3))
    torch.library.opcheck(cp.mla_partial_attention, (r(T, 4, 8), r(T, 4, 2), r(8, 4, 10), bt, qsl, kv_lens, 0.3))
    torch.library.opcheck(cp.lse_rescale, (r(T, 4, 6), lse, torch.cat([lse.T, r(4, T)])))
    # A head-permuted partial (strides of [H, T, Dv] transposed, as the PCP context part at dcp 2
    # hands it over): the outputs are contiguous like the fake's (Inductor asserted the strides)
    torch.library.opcheck(cp.lse_rescale, (r(4, T, 6).transpose(0, 1), lse.T.contiguous().T,
                                           torch.cat([lse.T, r(4, T)])))
    torch.library.opcheck(cp.lse_combine, (r(3, T, 4, 6), torch.stack([lse, lse, r(T, 4)])))


def test_localize_matches_layout():
    qsl, seq, slots, _ = _meta()
    s, ls, causal, ctx = cp.dcp_localize_metadata(slots, qsl, seq, 2, 1, 2, 4)
    assert torch.equal(s, layout.local_slot_mapping(slots, cp=2, rank=1, interleave=2, block_size=4))
    assert torch.equal(ls, layout.local_len(seq, cp=2, rank=1, interleave=2).int())
    assert torch.equal(causal, layout.local_causal_lens(qsl, seq, 8, cp=2, rank=1, interleave=2))
    assert torch.equal(ctx, layout.local_context_lens(qsl, seq, 8, cp=2, rank=1, interleave=2))


def test_merge_empty_shards_weigh_zero_and_all_empty_is_zero():
    outs = torch.randn(3, 4, 2, 5)
    lses = torch.randn(3, 4, 2)
    lses[1, 0] = float("-inf")
    outs[1, 0] = float("nan")  # garbage in an empty shard must not leak
    lses[:, 2] = float("-inf")  # every shard empty
    merged, total = cp.lse_combine(outs, lses)
    assert torch.isfinite(merged).all()
    assert torch.equal(merged[2], torch.zeros(2, 5))
    assert torch.isneginf(total[2]).all() and torch.isfinite(total[[0, 1, 3]]).all()
    # An empty (-inf) partial is left out exactly: the same as merging the others only.
    keep = torch.tensor([0, 2])
    want, _ = cp.lse_combine(outs[keep, 0:1], lses[keep, 0:1])
    torch.testing.assert_close(merged[0:1], want)
    perm = torch.tensor([2, 0, 1])
    torch.testing.assert_close(cp.lse_combine(outs[perm], lses[perm])[0], merged)
    # The AG+RS half gives the same result once summed over ranks.
    T, G = 4, 2
    lse_all = lses.permute(0, 2, 1).reshape(3 * G, T)  # head-major, as all-gathered
    summed = sum(cp.lse_rescale(outs[i], lses[i], lse_all)[0] for i in range(3))
    torch.testing.assert_close(summed, merged)
    assert torch.isneginf(cp.lse_rescale(outs[0], lses[0], lse_all)[1][2]).all()


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_merge_an_invalid_partial_is_loud_not_empty(poison: float):
    """A NaN (or +inf) LSE is no valid partial's: the row comes out NaN, in both merges, and
    only that row (decision 47). Reading it as empty, as the merge did before, turned decision
    41's kernel bug into finite, wrong attention."""
    outs = torch.randn(3, 4, 2, 5)
    lses = torch.randn(3, 4, 2)
    lses[2, 1] = poison  # rank 2's partial of token 1 (both heads) is garbage
    lses[0, 3, 0] = poison
    lses[1, 0] = float("-inf")  # an empty partial next to it stays empty
    bad = torch.zeros(4, 2, dtype=torch.bool)
    bad[1] = True
    bad[3, 0] = True
    merged, total = cp.lse_combine(outs, lses)
    assert torch.isnan(merged[bad]).all() and torch.isnan(total[bad]).all()
    assert torch.isfinite(merged[~bad]).all() and torch.isfinite(total[~bad]).all()
    T, G = 4, 2
    lse_all = lses.permute(0, 2, 1).reshape(3 * G, T)
    summed = sum(cp.lse_rescale(outs[i], lses[i], lse_all)[0] for i in range(3))
    assert torch.isnan(summed[bad]).all() and torch.isfinite(summed[~bad]).all()
    torch.testing.assert_close(summed, merged, equal_nan=True)
    assert torch.isnan(cp.lse_rescale(outs[0], lses[0], lse_all)[1][bad]).all()
    # The other rows are exactly the merge without the poisoned token.
    torch.testing.assert_close(merged[~bad], cp.lse_combine(outs[:, ~bad], lses[:, ~bad])[0])


def test_triton_kernels_registered_for_cuda():
    if not launcher.triton_available():
        pytest.fail("triton is part of the test extra; install it (pip install -e '.[test]')")
    regs = register_device_kernels()
    for op in DEVICE_KERNELS:
        assert f"{op}@cuda" in regs
        assert torch._C._dispatch_has_kernel_for_dispatch_key(op, "CUDA")
