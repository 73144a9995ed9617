"""`cp::mla_preprocess` (ops/mla_preprocess/ops.py): opcheck, and the op against the
example model's own unfused MLA projections (`MLAAttention.project`), bit for bit on
CPU (the reference runs the model's steps in the model's order), float and W8A8,
with and without q-LoRA, in every rope layout; the cache write; bad arguments refused."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import cp_compile.ops  # noqa: F401
from cp_compile.ops.mla_preprocess import ops as mla_ops
from cp_compile.ops.mla_preprocess import reference as ref
from examples.models.common import RotaryEmbedding
from examples.models.deepseek_mla import DeepseekMLAConfig, MLAAttention

cp = torch.ops.cp
T, NB, BS = 5, 4, 4
CFG = DeepseekMLAConfig(vocab_size=32, hidden_size=32, num_layers=1, num_heads=4, q_lora_rank=12, kv_lora_rank=16,
                        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, intermediate_size=16,
                        latent_norm_eps=1e-2)


def _layer(q_lora: int | None, interleave: bool, quant: bool, seed: int = 0) -> MLAAttention:
    cfg = dataclasses.replace(CFG, q_lora_rank=q_lora, rope_interleave=interleave, mla_quant=True if quant else None)
    attn = MLAAttention(cfg, 1, 0, None)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in attn.named_parameters():
            if p.dtype == torch.int8:
                p.copy_(torch.randint(-127, 128, p.shape, generator=g, dtype=torch.int8))
            elif name.endswith("weight_scale"):
                p.copy_(torch.rand(p.shape, generator=g) * 0.01 + 1e-3)
            elif name.endswith("weight_offset"):
                pass
            elif p.dim() == 1:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return attn


def _lin(mod):
    """(weight, scale, offset) of a float or W8A8 projection, as the op takes them."""
    if mod.weight.dtype == torch.int8:
        return mod.weight, mod.weight_scale, mod.weight_offset
    return mod.weight, None, None


def op_args(attn: MLAAttention, x, cos, sin, cache=None, slots=None):
    if attn.cfg.q_lora_rank is None:
        qa, qa_norm, qb = (None, None, None), None, _lin(attn.q_proj)
    else:
        qa, qa_norm, qb = _lin(attn.q_a_proj), attn.q_a_layernorm.weight, _lin(attn.q_b_proj)
    mode = "interleave" if attn.cfg.rope_interleave else "neox"
    return (x, *qa, qa_norm, *qb, *_lin(attn.kv_a_proj_with_mqa), attn.kv_a_layernorm.weight, attn.w_uk, cos, sin,
            cache, slots, attn.cfg.latent_norm_eps, attn.cfg.latent_norm_eps, mode)


def _inputs(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, CFG.hidden_size, generator=g)
    cos, sin = RotaryEmbedding(CFG.qk_rope_head_dim, 10000.0)(torch.tensor([0, 1, 2, 7, 3]))
    return x, cos, sin


CASES = [(12, True, False), (None, True, False), (12, False, False), (12, True, True), (None, False, True)]


@pytest.mark.parametrize("q_lora,interleave,quant", CASES)
def test_op_equals_the_unfused_projections_bitwise(q_lora, interleave, quant):
    attn = _layer(q_lora, interleave, quant)
    x, cos, sin = _inputs()
    with torch.no_grad():
        want = attn.project(x, cos, sin)  # q_abs, q_pe, kv_c, k_pe, q_resid (None without q-LoRA)
        got = cp.mla_preprocess(*op_args(attn, x, cos, sin))
    for name, w, o in zip(("q_abs", "q_pe", "kv_c", "k_pe"), want[:4], got[:4]):
        assert torch.equal(w, o), name
    if q_lora is None:
        assert got[4].shape == (T, 0)
    else:
        assert torch.equal(want[4], got[4])


def test_cache_write_and_padding_slot():
    attn = _layer(12, True, False)
    x, cos, sin = _inputs()
    cache = torch.full((NB, BS, CFG.latent_dim), 7.0)
    slots = torch.tensor([0, 1, 5, -1, 9])
    _, _, kv_c, k_pe, _ = cp.mla_preprocess(*op_args(attn, x, cos, sin, cache, slots))
    flat = cache.view(-1, CFG.latent_dim)
    latent = torch.cat([kv_c, k_pe], -1)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(flat[s], latent[t])
    untouched = [i for i in range(NB * BS) if i not in (0, 1, 5, 9)]
    assert torch.all(flat[untouched] == 7.0)


@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
def test_quant_op_writes_the_latent_as_quant_cache_write(kv_dtype):
    """cp::mla_preprocess_quant (issue 39): the same outputs as cp::mla_preprocess, and the latent
    in the cache as cp::quant_cache_write of [kv_c | k_pe] leaves it (codes byte-equal, scales
    equal), a padding slot skipped; body and CPU kernel alike. A cache in the model's dtype or a
    scale cache of the wrong shape is refused before anything is written."""
    attn = _layer(12, True, False)
    x, cos, sin = _inputs()
    slots = torch.tensor([0, 1, 5, -1, 9])
    with torch.no_grad():
        want = cp.mla_preprocess(*op_args(attn, x, cos, sin))
    want_c, want_s = torch.zeros(NB, BS, CFG.latent_dim, dtype=kv_dtype), torch.zeros(NB, BS, 1)
    cp.quant_cache_write(torch.cat([want[2], want[3]], -1), want_c, want_s, slots)
    assert (want_s.view(-1)[[0, 1, 5, 9]] > 0).all()
    # the registered op (on CPU: its CPU kernel) and the op's body (the reference)
    for fn in (cp.mla_preprocess_quant, mla_ops.mla_preprocess_quant._init_fn):
        codes, scales = torch.zeros_like(want_c), torch.zeros_like(want_s)
        args = op_args(attn, x, cos, sin)
        with torch.no_grad():
            got = fn(*args[:15], codes, scales, slots, *args[17:])
        for name, w, o in zip(("q_abs", "q_pe", "kv_c", "k_pe", "q_resid"), want, got):
            assert torch.equal(w, o), name
        assert torch.equal(codes.view(torch.uint8), want_c.view(torch.uint8)) and torch.equal(scales, want_s)
    args = op_args(attn, x, cos, sin)
    plain, scales = torch.zeros(NB, BS, CFG.latent_dim), torch.zeros(NB, BS, 1)
    with pytest.raises(ValueError, match=r"mla_preprocess_quant: kv_cache is torch.float32.*cp::mla_preprocess"):
        cp.mla_preprocess_quant(*args[:15], plain, scales, slots, *args[17:])
    codes = torch.zeros(NB, BS, CFG.latent_dim, dtype=kv_dtype)
    with pytest.raises(ValueError, match=r"scale cache \(\d+, \d+, 2\) torch.float32 does not fit"):
        cp.mla_preprocess_quant(*args[:15], codes, torch.zeros(NB, BS, 2), slots, *args[17:])
    assert not codes.view(torch.uint8).any() and not plain.any()


@pytest.mark.parametrize("q_lora,interleave,quant", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kernel_equals_the_reference_bitwise(q_lora, interleave, quant, dtype):
    """The CPU kernel (ops/mla_preprocess/cpu.py, what cp.mla_preprocess runs on CPU) gives the
    reference's values bit for bit in every rope layout, with a cache write skipping a -1 slot."""
    from cp_compile.ops.mla_preprocess.cpu import mla_preprocess_cpu

    attn = _layer(q_lora, interleave, quant)
    if dtype != torch.float32 and not quant:
        attn = attn.to(dtype)
    x, cos, sin = _inputs()
    slots = torch.tensor([0, 1, 5, -1, 9], dtype=torch.int32)
    modes = ("interleave", "interleave_split", "interleave_fp32") if interleave else ("neox",)
    for mode in modes:
        caches = [torch.full((NB, BS, CFG.latent_dim), 7.0, dtype=dtype) for _ in range(2)]
        args = [list(op_args(attn, x.to(dtype) if not quant else x, cos, sin, c, slots)) for c in caches]
        for a in args:
            a[-1] = mode
        with torch.no_grad():
            want = ref.mla_preprocess(*args[0])
            got = mla_preprocess_cpu(*args[1])
        for name, w, o in zip(("q_abs", "q_pe", "kv_c", "k_pe", "q_resid"), want, got):
            assert o.is_contiguous() and o.dtype == w.dtype, (mode, name)
            assert torch.equal(w, o), (mode, name)
        assert torch.equal(caches[0], caches[1]), mode


@pytest.mark.parametrize("q_lora,interleave,quant", [CASES[0], CASES[4]])
def test_opcheck(q_lora, interleave, quant):
    attn = _layer(q_lora, interleave, quant)
    x, cos, sin = _inputs()
    cache = torch.zeros(NB, BS, CFG.latent_dim)
    args = [a.detach().clone() if isinstance(a, torch.Tensor) else a
            for a in op_args(attn, x, cos, sin, cache, torch.tensor([0, 1, 5, -1, 9]))]
    torch.library.opcheck(cp.mla_preprocess, tuple(args))
    args[15] = args[16] = None  # no cache write
    torch.library.opcheck(cp.mla_preprocess, tuple(args))


def test_interleave_fp32_rotates_in_fp32():
    """`interleave_fp32` (HF DeepSeek-V2's complex rope on bf16 activations): the fp32 rotation of
    the bf16 input, cast once, which is HF's `view_as_real(view_as_complex(x.float()...) * freqs_cis)
    .type_as(x)` to fp32 rounding; `interleave` in bf16 rounds every product and is further off."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(T, 2, 8, generator=g).bfloat16()
    f = torch.randn(T, 4, generator=g) * 3
    table = torch.polar(torch.ones_like(f), f)  # [T, R/2] complex64, HF's freqs_cis
    hf = torch.view_as_real(torch.view_as_complex(x.float().reshape(T, 2, 4, 2)) * table[:, None]).flatten(2)
    hf = hf.type_as(x)
    got = ref.rope(x, table.real, table.imag, "interleave_fp32")
    assert got.dtype == torch.bfloat16
    one_ulp = (hf.float().abs() * 2 ** -7).clamp_min(2 ** -126)
    assert torch.all((got.float() - hf.float()).abs() <= one_ulp)  # at most one bf16 rounding apart
    bf16_err = (ref.rope(x, table.real, table.imag, "interleave").float() - hf.float()).abs().max()
    assert (got.float() - hf.float()).abs().max() < bf16_err


def test_rope_layouts_agree_on_scores():
    """The three layouts permute the rope dims the same way for q and k, so q . k agrees."""
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(T, 2, 8, generator=g), torch.randn(T, 1, 8, generator=g)
    cos, sin = RotaryEmbedding(8, 10000.0)(torch.arange(T))
    inter = (ref.rope(q, cos, sin, "interleave") * ref.rope(k, cos, sin, "interleave")).sum(-1)
    split = (ref.rope(q, cos, sin, "interleave_split") * ref.rope(k, cos, sin, "interleave_split")).sum(-1)
    torch.testing.assert_close(inter, split, rtol=1e-6, atol=1e-6)


def test_bad_arguments_are_refused_before_the_write():
    attn = _layer(12, True, False)
    x, cos, sin = _inputs()
    cache = torch.full((NB, BS, CFG.latent_dim), 7.0)
    args = list(op_args(attn, x, cos, sin, cache, torch.tensor([0, 1, 2, 3, 4])))
    bad_mode = args[:-1] + ["yarn"]
    with pytest.raises(ValueError, match="rope_mode='yarn'"):
        cp.mla_preprocess(*bad_mode)
    bad_norm = list(args)
    bad_norm[11] = torch.ones(3)
    with pytest.raises(ValueError, match="kv_norm"):
        cp.mla_preprocess(*bad_norm)
    no_slots = list(args)
    no_slots[16] = None
    with pytest.raises(ValueError, match="slot_mapping"):
        cp.mla_preprocess(*no_slots)
    assert torch.all(cache == 7.0)


_TAIL_CHECK = r"""
import torch, sys
sys.path.insert(0, ".")
from cp_compile.ops.mla_preprocess.triton_tail import mla_preprocess_tail_triton
from cp_compile.ops.core.triton_common import interpreter_active
assert interpreter_active()
# The tail alone in every rope layout, several tokens per program (persistent grid), no cache.
g = torch.Generator().manual_seed(5)
kv, q = torch.randn(7, 20, generator=g), torch.randn(7, 3, 10, generator=g)
w = torch.rand(16, generator=g) + 0.5
cos, sin = torch.rand(7, 2, generator=g), torch.rand(7, 2, generator=g)
from cp_compile.ops.mla_preprocess import reference as ref
for mode in ref.ROPE_MODES:
    kv_c, k_pe, q_pe = mla_preprocess_tail_triton(kv, q, w, cos, sin, 1e-2, mode, 6, num_programs=2)
    torch.testing.assert_close(kv_c, ref.rms_norm(kv[:, :16], w, 1e-2), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(k_pe, ref.rope(kv[:, None, 16:], cos, sin, mode)[:, 0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(q_pe, ref.rope(q[..., 6:], cos, sin, mode), rtol=1e-6, atol=1e-6)
# The quantised tail (issue 39): the latent's codes and per-token scale are the bytes
# cp::quant_cache_write writes for [kv_c | k_pe]; a -1 slot writes nothing; an all-zero row scale 1.
import cp_compile.ops  # registers cp::quant_cache_write (its CPU body)
kv[4] = 0.0
slots = torch.tensor([3, 0, -1, 9, 6, 1, 12])
for dt in (torch.int8, torch.float8_e4m3fn):
    codes, scales = torch.full((4, 4, 20), 5, dtype=torch.int8).to(dt), torch.full((4, 4, 1), 7.0)
    want_c, want_s = codes.clone(), scales.clone()
    kv_c, k_pe, _ = mla_preprocess_tail_triton(kv, q, w, cos, sin, 1e-2, "interleave", 6, codes, slots,
                                               num_programs=2, kv_scale_cache=scales)
    torch.ops.cp.quant_cache_write(torch.cat([kv_c, k_pe], -1), want_c, want_s, slots)
    assert torch.equal(codes.view(torch.uint8), want_c.view(torch.uint8)), dt
    assert torch.equal(scales, want_s), dt
    assert scales.view(-1)[6] == 1.0 and (scales.view(-1)[[2, 4, 5, 7, 8, 10, 11, 13, 14, 15]] == 7.0).all()
print("TAIL_OK")
"""


def test_tail_kernel_rope_layouts_under_the_triton_interpreter():
    """The Triton tail (norm + rope) in every rope layout, two programs over 7 tokens, under
    TRITON_INTERPRET=1, against the reference (the whole accelerator kernel with its cache
    write is tests/ops/test_device_kernels.py's case of cp::mla_preprocess); its quantised
    write (int8, fp8) == cp::quant_cache_write's bytes and scales."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = dict(os.environ, TRITON_INTERPRET="1")
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", _TAIL_CHECK], cwd=root, env=env, capture_output=True,
                          text=True, timeout=600)
    assert "TAIL_OK" in proc.stdout, proc.stdout + proc.stderr[-3000:]
