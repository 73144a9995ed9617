"""W8A8 linear ops (ops/quant/ops.py): opcheck, the int32 reference against an independent
int64 computation, and the identity the DSA-CP full-weight o_proj rests on: the
full weight run with groups = tp gives every TP shard's int32 accumulator bit for
bit, and the fp32 output equals the sum of the shards' outputs (bitwise at tp = 2)."""

from __future__ import annotations

import pytest
import torch

import cp_compile.ops.quant.ops  # noqa: F401
from cp_compile.ops.quant import reference as ref
from examples.models.quant import W8A8Config, W8A8RowParallelLinear, quantize_weight

cp = torch.ops.cp
T, IN, OUT = 7, 32, 12


def _dynamic_args(g: torch.Generator, groups: int, offset: bool = True):
    x = torch.randn(T, IN, generator=g)
    w = torch.randint(-127, 128, (IN, OUT), generator=g, dtype=torch.int8)
    ws = torch.rand(OUT, generator=g) * 0.01 + 1e-3
    wo = torch.randint(-3, 4, (OUT,), generator=g, dtype=torch.int32) if offset else torch.zeros(OUT, dtype=torch.int32)
    return x, w, ws, wo, groups


def _static_args(g: torch.Generator, groups: int):
    x = torch.randn(T, IN, generator=g)
    w = torch.randint(-127, 128, (IN, OUT), generator=g, dtype=torch.int8)
    s = torch.rand(groups, generator=g) * 0.02 + 0.01
    o = torch.randint(-5, 6, (groups,), generator=g, dtype=torch.int32)
    qb = torch.randint(-1000, 1000, (groups, OUT), generator=g, dtype=torch.int32)
    deq = torch.rand(groups, OUT, generator=g) * 1e-3
    return x, w, s, o, qb, deq


@pytest.mark.parametrize("groups", [1, 2])
def test_opcheck(groups):
    g = torch.Generator().manual_seed(0)
    torch.library.opcheck(cp.w8a8_dynamic_linear, _dynamic_args(g, groups))
    torch.library.opcheck(cp.w8a8_static_linear, _static_args(g, groups))
    x, *rest = _dynamic_args(g, groups)
    torch.library.opcheck(cp.w8a8_dynamic_linear, (x.bfloat16(), *rest))


def test_dynamic_reference_against_int64_loops():
    g = torch.Generator().manual_seed(1)
    x, w, ws, wo, G = _dynamic_args(g, 2)
    k = IN // G
    want = torch.zeros(T, OUT, dtype=torch.float64)
    for gi in range(G):
        xs = x[:, gi * k:(gi + 1) * k].double()
        s = xs.abs().amax(1) / 127  # [T]
        q = torch.clamp(torch.round(xs / s[:, None]), -127, 127).long()  # [T, k]
        acc = q @ (w[gi * k:(gi + 1) * k].long() - wo.long()[None, :])  # exact int64
        want += acc.double() * s.double()[:, None] * ws.double()[None, :]
    got = cp.w8a8_dynamic_linear(x, w, ws, wo, G)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    acc, _ = ref.w8a8_dynamic_accumulators(x, w, wo, G)
    assert acc.dtype == torch.int32


def test_static_reference_against_int64_loops():
    g = torch.Generator().manual_seed(2)
    x, w, s, o, qb, deq = _static_args(g, 2)
    k = IN // 2
    want = torch.zeros(T, OUT, dtype=torch.float64)
    for gi in range(2):
        q = torch.clamp(torch.round(x[:, gi * k:(gi + 1) * k].double() / float(s[gi])) + int(o[gi]), -128, 127).long()
        acc = q @ w[gi * k:(gi + 1) * k].long() + qb[gi].long()
        want += acc.double() * deq[gi].double()
    torch.testing.assert_close(cp.w8a8_static_linear(x, w, s, o, qb, deq).double(), want, rtol=1e-5, atol=1e-5)


def test_full_weight_groups_equal_the_shards_exactly():
    """What the full-weight o_proj relies on: groups = tp on the gathered weight is each
    shard's quantisation; int32 accumulators identical, fp32 output == sum of shards."""
    tp, g = 2, torch.Generator().manual_seed(3)
    k = IN // tp
    x, w, ws, wo, _ = _dynamic_args(g, tp)
    shards = [ref.w8a8_dynamic_accumulators(x[:, r * k:(r + 1) * k], w[r * k:(r + 1) * k], wo, 1) for r in range(tp)]
    acc, scale = ref.w8a8_dynamic_accumulators(x, w, wo, tp)
    for r in range(tp):
        assert torch.equal(acc[r], shards[r][0][0]) and torch.equal(scale[:, r], shards[r][1][:, 0])
    ys = [cp.w8a8_dynamic_linear(x[:, r * k:(r + 1) * k], w[r * k:(r + 1) * k], ws, wo, 1) for r in range(tp)]
    assert torch.equal(cp.w8a8_dynamic_linear(x, w, ws, wo, tp), ys[0] + ys[1])
    # Full-row quantisation (one scale per token over all of `in`) is a different scheme.
    assert not torch.equal(cp.w8a8_dynamic_linear(x, w, ws, wo, 1), ys[0] + ys[1])

    x, w, s, o, qb, deq = _static_args(g, tp)
    ys = [cp.w8a8_static_linear(x[:, r * k:(r + 1) * k], w[r * k:(r + 1) * k], s[r:r + 1], o[r:r + 1], qb[r:r + 1],
                                deq[r:r + 1]) for r in range(tp)]
    assert torch.equal(cp.w8a8_static_linear(x, w, s, o, qb, deq), ys[0] + ys[1])


@pytest.mark.parametrize("mode", ["dynamic", "static"])
def test_quantised_module_shards_gather_to_the_single_device_module(mode):
    """load_full on TP shards: the gathered parameters are the single-device module's,
    and the module approximates the float linear (W8A8 error, not a wiring error)."""
    tp, g = 2, torch.Generator().manual_seed(4)
    W = torch.randn(OUT, IN, generator=g) / IN ** 0.5
    q = W8A8Config(mode, input_scales=(0.03, 0.05), input_offsets=(2, -1)) if mode == "static" else \
        W8A8Config(mode, act_groups=tp)
    one = W8A8RowParallelLinear(IN, OUT, 1, 0, quant=q)
    one.load_full(W)
    parts = []
    for r in range(tp):
        m = W8A8RowParallelLinear(IN, OUT, tp, r, quant=q)
        m.load_full(W)
        parts.append(m)
    for name, p in one.named_parameters():
        sharded = name in ("weight", "input_scale", "input_offset", "quant_bias", "deq_scale")
        got = torch.cat([dict(m.named_parameters())[name] for m in parts]) if sharded else parts[1].get_parameter(name)
        assert torch.equal(got, p), name
    w_q, w_s = quantize_weight(W)
    assert torch.equal(one.weight, w_q.t()) and (w_q.abs() <= 127).all()
    x = torch.randn(T, IN, generator=g) * 0.5
    y = one(x)
    assert torch.equal(y, parts[0].local_linear(x[:, :IN // 2]) + parts[1].local_linear(x[:, IN // 2:]))
    err = (y - x @ W.t()).abs().max() / (x @ W.t()).abs().max()
    assert err < 0.05, err
