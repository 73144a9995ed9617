"""The torch_npu fused kernels (ops/paged/npu.py, ops/merge/npu.py) are aclgraph-safe: no host read, -1 slots
routed explicitly, and the kernels that need host lengths refuse a capture.

torch_npu cannot import here (it needs CANN), so the kernels run against a STAND-IN
`torch_npu` module (`FakeTorchNpu`, this file only) that records every call and holds
the callee to its documented preconditions: `npu_scatter_nd_update_` refuses
out-of-range or repeated indices, `npu_attention_update` is the page's formula
literally (NaN for an all -inf row), FIA returns +inf LSE for a row without keys
(one reading of "inf is invalid"). Host reads are caught by `HostReadMode` (tensors'
`.tolist()` / `.item()` / ... raise inside it).
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from cp_compile.ops.merge import reference as merge_reference
from cp_compile.ops.core import paged_cache
from cp_compile.ops.merge import npu as merge_npu
from cp_compile.ops.paged import npu as paged_npu
from cp_compile.testing.device_modes import HostRead, HostReadMode


class FakeTorchNpu(types.ModuleType):
    """STAND-IN for torch_npu: records calls; enforces the documented preconditions."""

    def __init__(self) -> None:
        super().__init__("torch_npu")
        self.calls: list[tuple[str, dict]] = []
        self.capturing = False
        self.npu = types.SimpleNamespace(is_current_stream_capturing=lambda: self.capturing)

    def npu_scatter_nd_update_(self, cache, idx, rows):
        # The preconditions are checked by `check_scatters` after the host-read mode:
        # checking them here would itself read the host.
        self.calls.append(("npu_scatter_nd_update_", dict(idx=idx.clone(), shape=tuple(cache.shape))))
        cache[idx[:, 0].clamp(0, cache.shape[0] - 1), idx[:, 1].clamp(0, cache.shape[1] - 1)] = rows
        return cache

    def check_scatters(self) -> None:
        for name, call in self.calls:
            if name == "npu_scatter_nd_update_":
                idx, bounds = call["idx"], torch.tensor(call["shape"][:2])
                assert bool(((idx >= 0) & (idx < bounds)).all()), f"index out of range: {idx.tolist()}"
                assert torch.unique(idx, dim=0).shape[0] == idx.shape[0], f"repeated index: {idx.tolist()}"

    def npu_attention_update(self, lses, outs, update_type):
        self.calls.append(("npu_attention_update", dict(update_type=update_type)))
        L, O = torch.stack(lses), torch.stack([o.float() for o in outs])
        m = L.max(0).values
        lse_m = m + torch.log(torch.exp(L - m).sum(0))
        return (O * torch.exp(L - lse_m)[..., None]).sum(0).to(outs[0].dtype), lse_m

    def npu_fused_infer_attention_score(self, q, k, v, **kw):
        self.calls.append(("npu_fused_infer_attention_score", kw))
        lens = torch.tensor(kw["actual_seq_lengths_kv"])
        T, _, H, _ = q.shape
        lse = torch.where(lens[:, None] > 0, torch.zeros(T, H), torch.full((T, H), float("inf")))
        return torch.zeros(T, 1, H, v.shape[-1] // kw["num_key_value_heads"], dtype=q.dtype), lse[..., None, None]


@pytest.fixture
def npu(monkeypatch) -> FakeTorchNpu:
    fake = FakeTorchNpu()
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    return fake


def test_cache_write_routes_minus_one_slots_without_host_read(npu: FakeTorchNpu) -> None:
    torch.manual_seed(0)
    cache = torch.randn(4, 4, 2, 8)
    new = torch.randn(7, 2, 8)
    slots = torch.tensor([0, -1, 5, -1, 3, -1, 15])  # slot 0 is taken: -1 rows must go elsewhere
    want = cache.clone()
    paged_cache.write_cache(want, new, slots)
    with HostReadMode():
        paged_npu._cache_write(new, cache, slots)
    npu.check_scatters()  # every index in range and distinct
    torch.testing.assert_close(cache, want, rtol=0, atol=0)
    assert [name for name, _ in npu.calls] == ["npu_scatter_nd_update_"]


def test_route_invalid_slots_gives_distinct_free_slots() -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(200):
        n_slots = int(torch.randint(8, 40, (1,), generator=g))
        T = int(torch.randint(1, n_slots + 1, (1,), generator=g))
        slots = torch.randperm(n_slots, generator=g)[:T]
        slots[torch.rand(T, generator=g) < 0.4] = -1
        with HostReadMode():
            target = paged_npu.route_invalid_slots(slots, n_slots)
        valid = slots >= 0
        assert torch.equal(target[valid], slots[valid])
        assert bool(((target >= 0) & (target < n_slots)).all()) and target.unique().numel() == T


def test_lse_combine_empty_rows_without_host_read(npu: FakeTorchNpu) -> None:
    torch.manual_seed(2)
    outs = torch.randn(2, 4, 3, 16, dtype=torch.bfloat16)
    lses = torch.randn(2, 4, 3)
    lses[0, 1, 0] = float("-inf")  # one empty shard
    lses[:, 2, 1] = float("-inf")  # no rank holds a key: the formula alone gives NaN
    lses[1, 3, 2] = float("nan")  # an invalid partial: its row is NaN, not empty (decision 47)
    with HostReadMode():
        merged, total = merge_npu._lse_combine(outs, lses)
    torch.testing.assert_close(merged, merge_reference.merge_partials(outs, lses), atol=2e-2, rtol=2e-2, equal_nan=True)
    assert merged[2, 1].abs().max() == 0 and total[2, 1] == float("-inf")
    assert bool(torch.isnan(merged[3, 2]).all()) and bool(torch.isnan(total[3, 2]))
    rest = torch.ones(4, 3, dtype=torch.bool)
    rest[2, 1] = rest[3, 2] = False
    assert bool(torch.isfinite(total[rest]).all()) and bool(torch.isfinite(merged[rest]).all())


def _fia_args():
    q = torch.randn(3, 4, 8, dtype=torch.bfloat16)
    kc = torch.randn(4, 4, 2, 8, dtype=torch.bfloat16)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    qsl = torch.tensor([0, 2, 3], dtype=torch.int32)
    kv_lens = torch.tensor([5, 0, 7], dtype=torch.int32)
    return q, kc, kc.clone(), table, qsl, kv_lens, 0.125


def test_fia_kernels_refuse_capture_before_any_host_read(npu: FakeTorchNpu) -> None:
    npu.capturing = True
    with HostReadMode(), pytest.raises(paged_npu.NpuCaptureUnsupported, match="max-autotune"):
        paged_npu._paged_attention_lse(*_fia_args())
    q, kc, _, table, qsl, kv_lens, scale = _fia_args()
    with HostReadMode(), pytest.raises(paged_npu.NpuCaptureUnsupported, match="host list"):
        paged_npu._mla_partial_attention(q, q[..., :4], kc.flatten(2)[..., :12], table, qsl, kv_lens, scale)
    assert npu.calls == []


def test_fia_kernels_read_lengths_on_the_host_only_outside_capture(npu: FakeTorchNpu) -> None:
    with HostReadMode(), pytest.raises(HostRead):  # the documented read, outside a capture
        paged_npu._paged_attention_lse(*_fia_args())
    out, lse = paged_npu._paged_attention_lse(*_fia_args())
    (name, kw), = npu.calls
    assert kw["actual_seq_lengths_kv"] == [5, 0, 7] and kw["num_key_value_heads"] == 2
    assert kw["block_table"].tolist() == [[0, 1], [0, 1], [2, 3]]  # each token's request row
    assert lse[1].eq(float("-inf")).all() and bool(torch.isfinite(lse[[0, 2]]).all())  # +inf cleaned
