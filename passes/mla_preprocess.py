"""MLAPO pass: each MLA layer's pre-attention subgraph -> one `cp::mla_preprocess` node.

Two pipeline stages in this file (docs/mla_preprocess.md):

1. `MLAPreprocessPass` (first in the pipeline, on the single-device graph). For
   every `cp::mla_attention` / `cp::sparse_mla_attention` node it walks back from
   the attention's four query / latent inputs and recognises, step by step, the
   subgraph `cp::mla_preprocess` computes:

       kv_c, k_pe   <- split(linear(x, kv_a), [L, R]); rms_norm(kv_c); rope(k_pe)
       q_abs        <- einsum("thn,hnl->thl", q_nope, W_UK)
       q_nope, q_pe <- split(view(linear(q_in, q_b), T, H, nope + R)); rope(q_pe)
       q_in         <- rms_norm(linear(x, q_a))  (q-LoRA)  |  x  (q_proj)

   in the layouts the example models and Hugging Face DeepSeek-V2 / V3 write it (HF: the
   [1, H, T, d] head layout, `cat((q_pass, q_embed))` then per-part slices; rope as
   interleaved pairs kept interleaved, interleaved pairs split into halves, neox
   halves (also HF's rotate_half), or V2's complex `freqs_cis` product). Linears are
   float (`F.linear`, no bias) or `cp::w8a8_dynamic_linear` (one group). Anything else
   (a bias, another rope, a different norm) is left as it is: the layer stays unfused,
   the pass's count says so and its warning names the reason (`NoMatch`). The
   attention's inputs are then read from the op, and the now unread unfused nodes are
   erased (with HF's per-head K expansion that only fed the ignored `key` argument). Every later pass sees the op's outputs where it saw the
   unfused values: DCP gathers them (the Q all-gather reads the op's q_abs / q_pe),
   PCP and DSA-CP run the op on the graph's own token rows.

2. `MLAPreprocessCacheWritePass` (after the parallel passes): where the latent the
   op returned is written to the cache by exactly one `cp::cache_write(cat([kv_c,
   k_pe]), cache, slots)` (DCP, SFA DCP, PCP decode: local slots; DSA-CP: global
   slots), the write moves into the op; on one device (dcp = pcp = 1) the attention
   op's own write moves into it and the attention becomes its no-write twin
   (`cp::mla_partial_attention` over causal lengths / `cp::sparse_mla_partial_attention`).
   A PCP prefill graph writes the PCP-gathered latents, not the op's, so it keeps its write.
"""

from __future__ import annotations

import operator
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

import cp_compile.ops.mla_preprocess.ops  # noqa: F401  (registers cp::mla_preprocess)
from cp_compile.passes.context import CompileContext
from cp_compile.passes.base import CPPass
from cp_compile.passes.fx_utils import fake_value

cp = torch.ops.cp
_LINEARS = (torch._C._nn.linear, F.linear)
_SPLITS = (torch.functional.split, torch.split)
_EINSUMS = (torch.functional.einsum, torch.einsum)
_ATTENTION = (cp.mla_attention.default, cp.mla_attention, cp.sparse_mla_attention.default, cp.sparse_mla_attention)
_PREPROCESS = (cp.mla_preprocess.default, cp.mla_preprocess)
_VIEW_METHODS = ("contiguous", "to", "float", "view", "reshape", "unsqueeze", "squeeze", "clone")


# ----------------------------------------------------------------------------- node helpers


def _fn(n: Any, *targets: Any) -> bool:
    return isinstance(n, fx.Node) and n.op == "call_function" and n.target in targets


def _method(n: Any, *names: str) -> bool:
    return isinstance(n, fx.Node) and n.op == "call_method" and n.target in names


def _arg(n: fx.Node, i: int, name: str, default: Any = None) -> Any:
    return n.args[i] if len(n.args) > i else n.kwargs.get(name, default)


def _tensor(n: Any) -> torch.Tensor | None:
    v = fake_value(n) if isinstance(n, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _dims(t: torch.Tensor) -> list[str]:
    """Shape without size-1 dims, symbols by name (no guards on symbolic sizes)."""
    return [str(d) for d in t.shape if str(d) != "1"]


def _same_values(n: fx.Node, inner: Any) -> bool:
    """n holds inner's elements in inner's order and dtype (a view / copy that only
    adds or drops size-1 dims)."""
    a, b = _tensor(n), _tensor(inner)
    return a is not None and b is not None and a.dtype == b.dtype and _dims(a) == _dims(b)


def _plain_index(idx: Any) -> bool:
    """Indices that only pick index 0 of size-1 dims, insert dims or keep dims whole."""
    items = idx if isinstance(idx, tuple) else (idx,)
    return all(i is None or i is Ellipsis or i == 0 or i == slice(None) for i in items)


def strip(n: Any) -> Any:
    """Through value-preserving views and copies (contiguous, same-dtype casts,
    reshapes that only move size-1 dims), to the node that computed the values."""
    while isinstance(n, fx.Node) and n.args and isinstance(n.args[0], fx.Node):
        if _method(n, *_VIEW_METHODS) or (_fn(n, operator.getitem) and _plain_index(n.args[1])):
            if _same_values(n, n.args[0]):
                n = n.args[0]
                continue
        break
    return n


def _last_dim_slice(n: Any) -> slice | None:
    """getitem(t, (..., slice)) -> the slice on the last dim."""
    if _fn(n, operator.getitem) and isinstance(n.args[1], tuple) and len(n.args[1]) == 2 \
            and n.args[1][0] is Ellipsis and isinstance(n.args[1][1], slice):
        return n.args[1][1]
    return None


def _mul_operands(n: Any) -> tuple[Any, Any] | None:
    return (n.args[0], n.args[1]) if _fn(n, operator.mul, torch.mul) and len(n.args) == 2 else None


def _is_float_literal(v: Any) -> bool:
    return isinstance(v, float) and not isinstance(v, bool)


# ----------------------------------------------------------------------------- recognisers


@dataclass
class Linear:
    x: fx.Node
    weight: fx.Node
    scale: fx.Node | None = None
    offset: fx.Node | None = None


def match_linear(n: Any) -> Linear | None:
    """F.linear without bias, or cp::w8a8_dynamic_linear over one activation group."""
    if _fn(n, *_LINEARS) and _arg(n, 2, "bias") is None:
        return Linear(n.args[0], _arg(n, 1, "weight"))
    if _fn(n, cp.w8a8_dynamic_linear.default, cp.w8a8_dynamic_linear) and len(n.args) == 5 and n.args[4] == 1:
        return Linear(*n.args[:4])
    return None


def match_rms_norm(n: Any) -> tuple[fx.Node, fx.Node, float] | None:
    """weight * (xf * rsqrt(mean(xf ** 2, -1, keepdim) + eps)).to(dtype), xf = x.float()
    -> (x, weight, eps)."""
    ops = _mul_operands(n)
    if ops is None:
        return None
    for weight, normed in (ops, ops[::-1]):
        inner = normed
        if _method(inner, "to", "float"):
            inner = inner.args[0]
        prod = _mul_operands(inner)
        if prod is None:
            continue
        xf, r = prod
        if not _fn(r, torch.rsqrt):
            continue
        add = r.args[0]
        if not (_fn(add, operator.add) and _is_float_literal(add.args[1])):
            continue
        mean = add.args[0]
        if not (_method(mean, "mean") and tuple(mean.args[1:]) in ((-1,), ) and mean.kwargs.get("keepdim")):
            continue
        pw = mean.args[0]
        if not (_method(pw, "pow") and pw.args[0] is xf and pw.args[1] == 2):
            continue
        if not (_method(xf, "float") or (_method(xf, "to") and torch.float32 in (*xf.args[1:], *xf.kwargs.values()))):
            continue
        w = _tensor(weight)
        if w is None or w.dim() != 1:
            continue
        return xf.args[0], weight, float(add.args[1])
    return None


@dataclass
class Rope:
    x: fx.Node  # the unrotated input
    cos: fx.Node  # [..., R/2] source of cos (reshaped to [T, R/2] for the op)
    sin: fx.Node
    mode: str
    # cos / sin are full width [..., R] with equal halves (HF `cat((freqs, freqs))`, the
    # rotate_half form): the op takes their first half.
    full_width: bool = False
    # cos / sin are one complex table [..., R/2] (HF DeepSeek-V2's `freqs_cis`): the op takes
    # its real and imaginary parts.
    complex_table: bool = False


def _rotation(sub: Any, add: Any) -> tuple[Any, Any, Any, Any] | None:
    """sub = x1*c - x2*s, add = x2*c + x1*s -> (x1, x2, c, s)."""
    if not (_fn(sub, operator.sub) and _fn(add, operator.add)):
        return None
    m = [_mul_operands(a) for a in (*sub.args, *add.args)]
    if any(x is None for x in m) or len(m) != 4:
        return None
    (x1, c), (x2, s), (x2b, c2), (x1b, s2) = m
    if x1 is x1b and x2 is x2b and c is c2 and s is s2:
        return x1, x2, c, s
    return None


def _cat_pair(n: Any) -> tuple[Any, Any] | None:
    if _fn(n, torch.cat) and _arg(n, 1, "dim", 0) == -1:
        parts = n.args[0]
        if isinstance(parts, (list, tuple)) and len(parts) == 2:
            return parts[0], parts[1]
    return None


def _angle_source(c: Any, dtype: torch.dtype) -> Any:
    """cos / sin through its cast to the activation dtype (`cos.to(x.dtype)`, which the op
    does itself): q's and k's rope each cast the same table, and both casts are one source."""
    n = strip(c)
    while _method(n, "to") and _tensor(n) is not None and _tensor(n).dtype == dtype and n.args \
            and isinstance(n.args[0], fx.Node):
        n = strip(n.args[0])
    return n


def _duplicated_halves(n: Any) -> bool:
    """n is elementwise of `cat((f, f), -1)` (HF's rotary table: `emb = cat((freqs, freqs))`,
    `cos = emb.cos() * scaling`, cast): its two halves hold equal values."""
    while True:
        if _method(n, "to", "cos", "sin", "float") or _fn(n, torch.cos, torch.sin):
            n = n.args[0]
        elif _fn(n, operator.mul, torch.mul) and len(n.args) == 2 and _is_float_literal(n.args[1]):
            n = n.args[0]
        elif _fn(n, operator.mul, torch.mul) and len(n.args) == 2 and _is_float_literal(n.args[0]):
            n = n.args[1]
        elif isinstance(n, fx.Node) and n is not strip(n):
            n = strip(n)
        else:
            break
    pair = _cat_pair(n)
    return pair is not None and pair[0] is pair[1]


def _rotate_half(n: Any) -> Rope | None:
    """HF `apply_rotary_pos_emb` (rope_interleave=False): add(x * cos, cat((-x2, x1), -1) * sin),
    x1 / x2 = x's halves, cos / sin full width. The op's neox mode computes the same
    x1 * c - x2 * s, x2 * c + x1 * s (a + (-b) == a - b in IEEE arithmetic), with c the
    first half of cos; taken only where the table's halves are provably equal."""
    if not (_fn(n, operator.add) and len(n.args) == 2):
        return None
    straight, rotated = _mul_operands(n.args[0]), _mul_operands(n.args[1])
    if straight is None or rotated is None:
        return None
    (x, c), (rot, s) = straight, rotated
    pair = _cat_pair(rot)
    if pair is None or not _fn(pair[0], operator.neg, torch.neg):
        return None
    x2, x1 = pair[0].args[0], pair[1]
    t = _tensor(x)
    if t is None or not (_fn(x1, operator.getitem) and _fn(x2, operator.getitem)) \
            or x1.args[0] is not x or x2.args[0] is not x:
        return None
    half = t.shape[-1] // 2
    if _last_dim_slice(x1) != slice(None, half, None) or _last_dim_slice(x2) != slice(half, None, None):
        return None
    cos, sin = _angle_source(c, t.dtype), _angle_source(s, t.dtype)
    if not (_duplicated_halves(cos) and _duplicated_halves(sin)):
        return None
    return Rope(x, cos, sin, "neox", full_width=True)


def _complex_rope(n: Any) -> Rope | None:
    """HF DeepSeek-V2 `apply_rotary_emb`: view_as_real(view_as_complex(x.float().reshape(..., R/2, 2))
    * freqs_cis).flatten(-2).type_as(x). Pairs (2i, 2i + 1) are a + bi; times cos + i sin they are
    (a c - b s, b c + a s), kept interleaved: the op's `interleave` mode (`interleave_fp32` for a
    bf16 / fp16 x: HF rotates in fp32 and casts back), with cos / sin the table's real / imaginary
    parts. Taken only for a complex64 table of one row per token, shared by every head."""
    if not (_method(n, "type_as", "to") and n.args):
        return None
    out, flat = _tensor(n), n.args[0]
    ft = _tensor(flat)
    vr = flat.args[0] if _method(flat, "flatten") else None
    rot = _mul_operands(vr.args[0]) if _fn(vr, torch.view_as_real) else None
    if rot is None or out is None or ft is None:
        return None
    for xc, table in (rot, rot[::-1]):
        if _fn(xc, torch.view_as_complex):
            break
    else:
        return None
    pairs, tab = xc.args[0], _tensor(table)
    src, pt = (pairs.args[0], _tensor(pairs)) if _method(pairs, "reshape", "view") else (None, None)
    if _method(src, "float") or (_method(src, "to") and torch.float32 in (*src.args[1:], *src.kwargs.values())):
        src = src.args[0]  # x.float(): a real cast for bf16 / fp16, none for fp32
    x = strip(src)
    xt = _tensor(x)
    if xt is None or pt is None or tab is None or tab.dtype != torch.complex64 or pt.dtype != torch.float32 \
            or out.dtype != xt.dtype or not xt.dtype.is_floating_point:
        return None
    R = xt.shape[-1]
    if pt.shape[-1] != 2 or pt.shape[-2] != R // 2 or _dims(pt)[:-2] != _dims(xt)[:-1] \
            or ft.dim() != pt.dim() - 1 or ft.shape[-1] != R or _dims(ft) != _dims(xt):
        return None
    if tab.shape[-1] != R // 2 or len(_dims(tab)) != 2 or _dims(tab)[0] != _dims(xt)[-2]:
        return None  # not one [T, R/2] row per token for every head
    mode = "interleave" if xt.dtype == torch.float32 else "interleave_fp32"
    src_table = strip(table)
    return Rope(x, src_table, src_table, mode, complex_table=True)


def match_rope(n: Any) -> Rope | None:
    """The three rope layouts of `mla_preprocess_reference.rope`, on the last dim (neox also
    in HF's rotate_half form, interleave also in HF DeepSeek-V2's complex-number form)."""
    if (r := _rotate_half(n)) is not None or (r := _complex_rope(n)) is not None:
        return r
    rot, mode = None, None
    if _method(n, "flatten") and tuple(n.args[1:]) == (-2,) and _fn(n.args[0], torch.stack) \
            and _arg(n.args[0], 1, "dim") == -1 and len(n.args[0].args[0]) == 2:
        rot, mode = _rotation(*n.args[0].args[0]), "interleave"
    elif _cat_pair(n) is not None:
        rot = _rotation(*_cat_pair(n))
        mode = "cat"
    if rot is None:
        return None
    x1, x2, c, s = rot
    s1, s2 = _last_dim_slice(x1), _last_dim_slice(x2)
    if s1 is None or s2 is None or x1.args[0] is not x2.args[0]:
        return None
    src = x1.args[0]
    t = _tensor(src)
    if t is None:
        return None
    half = t.shape[-1] // 2
    pairs = s1 == slice(0, None, 2) and s2 == slice(1, None, 2)
    halves = s1 == slice(None, half, None) and s2 == slice(half, None, None)
    if mode == "interleave" and not pairs:
        return None
    if mode == "cat":
        mode = "interleave_split" if pairs else "neox" if halves else None
        if mode is None:
            return None
    return Rope(src, _angle_source(c, t.dtype), _angle_source(s, t.dtype), mode)


# ----------------------------------------------------------------------------- one layer


@dataclass
class LayerMatch:
    attention: fx.Node
    x: fx.Node
    q_a: Linear | None
    q_a_norm: fx.Node | None
    q_eps: float
    q_b: Linear
    kv_a: Linear
    kv_norm: fx.Node
    kv_eps: float
    w_uk: fx.Node
    cos: fx.Node
    sin: fx.Node
    rope_mode: str
    q_resid: fx.Node | None  # the unfused q_resid node (its other readers get the op's)
    full_width: bool = False  # cos / sin [..., R] with equal halves (Rope.full_width)
    complex_table: bool = False  # cos = sin = one complex table (Rope.complex_table)


def _split_part(n: Any, sizes: list[int]) -> tuple[fx.Node, int] | None:
    """getitem(split(t, sizes, dim=-1), i) -> (t, i)."""
    if _fn(n, operator.getitem) and isinstance(n.args[1], int) and _fn(n.args[0], *_SPLITS):
        sp = n.args[0]
        if list(_arg(sp, 1, "split_size_or_sections")) == sizes and _arg(sp, 2, "dim", 0) == -1:
            return sp.args[0], n.args[1]
    return None


def _token_major_q(qh: Any, width: int) -> fx.Node | None:
    """view(q_lin, T, H, nope + R) -> q_lin [T, H * (nope + R)]."""
    if _method(qh, "view", "reshape"):
        q, v = _tensor(qh.args[0]), _tensor(qh)
        if q is not None and v is not None and v.dim() == 3 and v.shape[-1] == width and q.dim() == 2 \
                and str(v.shape[0]) == str(q.shape[0]):
            return qh.args[0]
    return None


def _head_major_q(q4: Any, width: int) -> fx.Node | None:
    """HF: view(q_lin, (1, T, -1, nope + R)).transpose(1, 2) -> q_lin [1, T, H * (nope + R)]."""
    if _method(q4, "transpose") and tuple(q4.args[1:]) == (1, 2) and _method(q4.args[0], "view"):
        v, q = _tensor(q4.args[0]), _tensor(q4.args[0].args[0])
        if v is not None and q is not None and v.dim() == 4 and str(v.shape[0]) == "1" and v.shape[-1] == width \
                and q.dim() == 3 and str(q.shape[0]) == "1":
            return q4.args[0].args[0]
    return None


def _token_major_head(n: Any) -> fx.Node | None:
    """t[0].transpose(0, 1) -> t ([1, H, T, d] -> [T, H, d])."""
    if _method(n, "transpose") and tuple(n.args[1:]) == (0, 1) and _fn(n.args[0], operator.getitem) \
            and n.args[0].args[1] == 0:
        return n.args[0].args[0]
    return None


def _hf_query_parts(q_nope: Any, q_pe: Any, nope: int) -> tuple[fx.Node, fx.Node] | None:
    """HF: q = cat((q_pass, q_embed), -1)[0].transpose(0, 1); q_nope = q[..., :nope],
    q_pe = q[..., nope:] (cp_compile/hf/attention.py), or each part on its own,
    q_nope = q_pass[0].transpose(0, 1), q_pe = q_embed[0].transpose(0, 1)
    (cp_compile/hf/sfa.py) -> (q_pass, q_embed), both [1, H, T, d]."""
    a, b = _token_major_head(q_nope), _token_major_head(q_pe)
    if a is not None and b is not None and _tensor(a) is not None and _tensor(a).shape[-1] == nope:
        return a, b
    s1, s2 = _last_dim_slice(q_nope), _last_dim_slice(q_pe)
    if s1 != slice(None, nope, None) or s2 != slice(nope, None, None) or q_nope.args[0] is not q_pe.args[0]:
        return None
    q = q_nope.args[0]
    if not (_method(q, "transpose") and tuple(q.args[1:]) == (0, 1) and _fn(q.args[0], operator.getitem)
            and q.args[0].args[1] == 0):
        return None
    pair = _cat_pair(q.args[0].args[0])
    if pair is None or _tensor(pair[0]) is None or _tensor(pair[0]).shape[-1] != nope:
        return None
    return pair


class NoMatch(Exception):
    """Why one MLA layer's pre-processing is not the op's (the pass's warning names it)."""


def _need(value: Any, reason: str) -> Any:
    if value is None or value is False:
        raise NoMatch(reason)
    return value


def _param_name(n: Any) -> str:
    """The weight's graph name, e.g. `l_..._kv_a_proj_with_mqa_parameters_weight_`."""
    return n.name if isinstance(n, fx.Node) else repr(n)


def _need_linear(n: Any, role: str) -> Linear:
    """match_linear or NoMatch naming why (a bias, a grouped W8A8, another producer)."""
    lin = match_linear(n)
    if lin is not None:
        return lin
    if _fn(n, *_LINEARS):
        raise NoMatch(f"{role} ({_param_name(_arg(n, 1, 'weight'))}) has a bias "
                      f"({_param_name(_arg(n, 2, 'bias'))}; HF: config.attention_bias=True); cp::mla_preprocess's "
                      "projections are bias-free, so the layer runs unfused. Fix: serve a checkpoint without "
                      "attention_bias, or leave enable_mla_preprocess off for it")
    if _fn(n, cp.w8a8_dynamic_linear.default, cp.w8a8_dynamic_linear):
        raise NoMatch(f"{role} is cp::w8a8_dynamic_linear over {n.args[4] if len(n.args) > 4 else '?'} activation "
                      "groups; the op quantises per token in one group")
    raise NoMatch(f"{role} is computed by {_describe(n)}, not F.linear / cp::w8a8_dynamic_linear")


def _describe(n: Any) -> str:
    if not isinstance(n, fx.Node):
        return repr(n)
    target = n.target if n.op == "call_method" else getattr(n.target, "__name__", n.target)
    return f"{n.op} {target} (node {n.name})"


def _rope_reason(n: Any, which: str) -> str:
    return (f"{which}'s rope ({_describe(n)}) is none of the recognised forms (interleaved pairs, split "
            "halves, neox / rotate_half over a cat((freqs, freqs)) table, HF DeepSeek-V2's complex64 freqs_cis "
            "with one row per token)")


def match_layer(attention: fx.Node) -> LayerMatch:
    """The unfused preprocessing feeding one attention node; NoMatch(reason) if it is not the op's."""
    q_abs_arg, q_pe_arg, kv_c_arg, k_pe_arg = attention.args[:4]
    # kv side: split(linear(x, kv_a), [L, R]) -> norm(kv_c), rope(k_pe)
    kv_c_raw, kv_norm, kv_eps = _need(match_rms_norm(strip(kv_c_arg)),
                                      f"kv_c ({_describe(strip(kv_c_arg))}) is not an RMSNorm "
                                      "(weight * (x.float() * rsqrt(mean(x ** 2, -1) + eps)).to(dtype))")
    k_rope = _need(match_rope(strip(k_pe_arg)), _rope_reason(strip(k_pe_arg), "k_pe"))
    L, R = _tensor(kv_norm).shape[0], _tensor(k_rope.x).shape[-1]
    kv_part = _split_part(strip(kv_c_raw), [L, R])
    k_part = _split_part(strip(k_rope.x), [L, R])
    _need(kv_part is not None and k_part is not None and kv_part == (k_part[0], 0) and k_part[1] == 1,
          f"kv_c and k_pe are not the [L = {L}, R = {R}] split of one projection")
    kv_a = _need_linear(strip(kv_part[0]), "kv_a_proj_with_mqa")
    x = kv_a.x
    # q side: einsum(q_nope, W_UK)
    einsum = strip(q_abs_arg)
    _need(_fn(einsum, *_EINSUMS) and einsum.args[0] == "thn,hnl->thl" and len(einsum.args) == 3,
          f"q_abs ({_describe(einsum)}) is not einsum('thn,hnl->thl', q_nope, W_UK)")
    q_nope, w_uk = einsum.args[1], einsum.args[2]
    wt = _tensor(w_uk)
    _need(wt is not None and wt.dim() == 3 and wt.shape[-1] == L, f"W_UK is not [H, nope, L = {L}]")
    nope = wt.shape[1]
    q_pe = strip(q_pe_arg)
    hf = _hf_query_parts(q_nope, q_pe, nope)
    if hf is not None:  # HF head layout
        pass_part = _split_part(hf[0], [nope, R])
        q_rope = _need(match_rope(hf[1]), _rope_reason(hf[1], "q_pe"))
        _need(pass_part is not None and pass_part[1] == 0 and _split_part(q_rope.x, [nope, R]) == (pass_part[0], 1),
              f"q_nope and q_pe are not the [nope = {nope}, R = {R}] split of one query")
        q_lin = _head_major_q(pass_part[0], nope + R)
    else:  # token-major (example models)
        nope_part = _split_part(q_nope, [nope, R])
        q_rope = _need(match_rope(q_pe), _rope_reason(q_pe, "q_pe"))
        _need(nope_part is not None and nope_part[1] == 0 and _split_part(q_rope.x, [nope, R]) == (nope_part[0], 1),
              f"q_nope and q_pe are not the [nope = {nope}, R = {R}] split of one query")
        q_lin = _token_major_q(nope_part[0], nope + R)
    _need(q_lin, "the query is not the [T, H, nope + R] (or HF [1, H, T, nope + R]) view of one projection")
    _need((q_rope.mode, q_rope.full_width, q_rope.complex_table)
          == (k_rope.mode, k_rope.full_width, k_rope.complex_table)
          and strip(q_rope.cos) is strip(k_rope.cos) and strip(q_rope.sin) is strip(k_rope.sin),
          f"q_pe and k_pe are rotated differently (q {q_rope.mode}, k {k_rope.mode}) or by different tables")
    q_b = _need_linear(strip(q_lin), "q_b_proj / q_proj")
    q_in = strip(q_b.x)
    q_a = q_a_norm = q_resid = None
    q_eps = 0.0
    if q_in is not strip(x):
        q_norm = _need(match_rms_norm(q_in), f"q_b_proj's input ({_describe(q_in)}) is neither the layer's "
                                             "hidden states nor an RMSNorm (q_a_layernorm)")
        q_a = _need_linear(strip(q_norm[0]), "q_a_proj")
        _need(strip(q_a.x) is strip(x), "q_a_proj and kv_a_proj_with_mqa read different hidden states")
        q_resid, q_a_norm, q_eps = q_in, q_norm[1], q_norm[2]
    _need(_tensor(x) is not None and _tensor(x).dim() in (2, 3), "the hidden states are not [T, D] or [1, T, D]")
    return LayerMatch(attention, x, q_a, q_a_norm, q_eps, q_b, kv_a, kv_norm, kv_eps, w_uk, k_rope.cos, k_rope.sin,
                      k_rope.mode, q_resid, k_rope.full_width, k_rope.complex_table)


# ----------------------------------------------------------------------------- rewriting


def _is_pure(n: fx.Node) -> bool:
    if n.op == "call_method":
        return not str(n.target).endswith("_")
    if n.op != "call_function":
        return False
    schema = getattr(n.target, "_schema", None)
    if schema is None and hasattr(n.target, "default"):
        schema = getattr(n.target.default, "_schema", None)
    if schema is not None and schema.is_mutable:
        return False
    return n.target is not torch._C._log_api_usage_once


def erase_unread(graph: fx.Graph, roots: list[fx.Node]) -> int:
    """Erase `roots` and their producers once nothing reads them (pure nodes only)."""
    work, erased = list(roots), set()
    while work:
        n = work.pop()
        if n in erased or n.users or not _is_pure(n):
            continue
        inputs = list(n.all_input_nodes)
        graph.erase_node(n)
        erased.add(n)
        work.extend(inputs)
    return len(erased)


def drop_unread_buffers(graph: fx.Graph) -> list[fx.Node]:
    """HF's per-head K (`key_states = new_empty(...)`, filled by `copy_` into slices)
    is only passed to the attention function, which ignores it: when nothing else
    reads the buffer, erase it and its fills; return what they read."""
    freed: list[fx.Node] = []
    for buf in [n for n in graph.nodes if _method(n, "new_empty")]:
        slices = list(buf.users)
        fills = [u for s in slices for u in s.users]
        if not slices or not all(_fn(s, operator.getitem) for s in slices) \
                or not all(_method(f, "copy_") and not f.users for f in fills) \
                or any(len(s.users) != 1 for s in slices):
            continue
        for f in fills:
            freed.extend(a for a in f.all_input_nodes if a not in slices)
            graph.erase_node(f)
        for s in slices:
            graph.erase_node(s)
        freed.extend(buf.all_input_nodes)
        graph.erase_node(buf)
    return freed


def _complex_parts(graph: fx.Graph, table: fx.Node) -> tuple[fx.Node, fx.Node]:
    """A complex table [..., R/2] -> its real and imaginary parts [T, R/2] (cos, sin)."""
    width = _tensor(table).shape[-1]
    with graph.inserting_after(table):
        parts = graph.call_function(torch.view_as_real, (table,))  # [..., R/2, 2]
    out = []
    for i in (1, 0):
        with graph.inserting_after(parts):
            part = graph.call_function(operator.getitem, (parts, (Ellipsis, i)))
        with graph.inserting_after(part):
            out.insert(0, graph.call_method("reshape", (part, -1, width)))
    return out[0], out[1]


def _cos_sin_for_op(graph: fx.Graph, src: fx.Node, full_width: bool) -> fx.Node:
    """cos / sin as the op takes them: [T, R/2] (the example's [T, R/2], HF's [1, T, R/2] slice;
    HF's full-width rotate_half table [1, T, R]: its first half)."""
    t = _tensor(src)
    width = t.shape[-1] // 2 if full_width else t.shape[-1]
    if full_width:
        with graph.inserting_after(src):
            src = graph.call_function(operator.getitem, (src, (Ellipsis, slice(None, width, None))))
    if t.dim() == 2 and not full_width:
        return src
    with graph.inserting_after(src):
        return graph.call_method("reshape", (src, -1, width))


def _flat_x(graph: fx.Graph, x: fx.Node) -> fx.Node:
    t = _tensor(x)
    if t.dim() == 2:
        return x
    with graph.inserting_after(x):  # HF: [1, T, D]
        return graph.call_method("reshape", (x, -1, t.shape[-1]))


def rewrite_layer(graph: fx.Graph, m: LayerMatch) -> fx.Node:
    """Insert the op after the last of its inputs; the attention reads its outputs."""
    if m.complex_table:
        cos, sin = _complex_parts(graph, m.cos)
    else:
        cos, sin = _cos_sin_for_op(graph, m.cos, m.full_width), _cos_sin_for_op(graph, m.sin, m.full_width)
    x = _flat_x(graph, m.x)
    q_a = m.q_a or Linear(x, None)  # type: ignore[arg-type]
    inputs = [x, q_a.weight, q_a.scale, q_a.offset, m.q_a_norm, m.q_b.weight, m.q_b.scale, m.q_b.offset,
              m.kv_a.weight, m.kv_a.scale, m.kv_a.offset, m.kv_norm, m.w_uk, cos, sin]
    order = _order(graph)
    last = max((n for n in inputs if isinstance(n, fx.Node)), key=order.__getitem__)
    with graph.inserting_after(last):
        op = graph.call_function(cp.mla_preprocess.default,
                                 (*inputs, None, None, m.q_eps, m.kv_eps, m.rope_mode))
    outs = []
    with graph.inserting_after(op):
        for i in reversed(range(5)):
            outs.insert(0, graph.call_function(operator.getitem, (op, i)))
    old = list(m.attention.args[:4])
    for i, node in enumerate(old):
        m.attention.replace_input_with(node, outs[i])
    if m.q_resid is not None and _tensor(m.q_resid).dim() == 2:  # [T, q_lora], the op's layout
        # Other readers (the DSA indexer) take the op's q_resid where it is already computed.
        pos = order[last]
        for user in list(m.q_resid.users):
            if order.get(user, -1) > pos and _tensor(user) is not None:
                user.replace_input_with(m.q_resid, outs[4])
    erase_unread(graph, [n for n in old if isinstance(n, fx.Node)])
    return op


def _order(graph: fx.Graph) -> dict[fx.Node, int]:
    return {n: i for i, n in enumerate(graph.nodes)}


class _MLAPOStage(CPPass):
    """Both stages: enabled by the one config flag, which is all they read."""

    enabled_when = "enable_mla_preprocess (CPConfig)"

    @classmethod
    def is_enabled(cls, ctx: CompileContext) -> bool:
        return ctx.config.enable_mla_preprocess


class MLAPreprocessPass(_MLAPOStage):
    """Fuse each MLA layer's pre-attention subgraph into `cp::mla_preprocess`."""

    name = "mla_preprocess"

    def __call__(self, gm: fx.GraphModule) -> int:
        graph = gm.graph
        attentions = [n for n in graph.nodes if _fn(n, *_ATTENTION)]
        if not attentions:
            return 0
        erase_unread(graph, drop_unread_buffers(graph))
        count = 0
        reasons: dict[str, list[str]] = {}
        for node in attentions:
            try:
                m = match_layer(node)
            except NoMatch as e:
                reasons.setdefault(str(e), []).append(node.name)
                continue
            rewrite_layer(graph, m)
            count += 1
        if count < len(attentions):
            # Enabled but not (fully) applied: exact either way, but the user asked for the fusion
            # (issue 19: no silent no-op); each distinct reason once, with the attention nodes it holds for.
            why = "; ".join(f"[{', '.join(nodes)}] {r}" for r, nodes in reasons.items())
            warnings.warn(f"mla_preprocess: enable_mla_preprocess is on but {len(attentions) - count} of "
                          f"{len(attentions)} MLA attention layers in this graph do not match the pre-processing "
                          f"pattern (passes/mla_preprocess.py); those layers run unfused (exact, not fused): {why}",
                          stacklevel=2)
        if count:
            graph.lint()
            gm.recompile()
        return count


# ----------------------------------------------------------------------------- the cache write


def _output(op: fx.Node, i: int) -> fx.Node | None:
    return next((u for u in op.users if _fn(u, operator.getitem) and u.args[1] == i), None)


def _hoist_before(graph: fx.Graph, node: fx.Node, anchor: fx.Node, order: dict[fx.Node, int]) -> bool:
    """Move `node` and whatever it needs that comes after `anchor` to just before
    `anchor` (pure nodes whose inputs are all placeholders or earlier). False if
    something impure or dependent on `anchor` would have to move."""
    pos = order[anchor]
    need: list[fx.Node] = []

    def visit(n: fx.Node) -> bool:
        if order.get(n, -1) < pos or n in need:
            return True
        if n is anchor or not _is_pure(n) and not _fn(n, cp.dcp_localize_metadata.default):
            return False
        if not all(visit(a) for a in n.all_input_nodes):
            return False
        need.append(n)
        return True

    if not visit(node):
        return False
    for n in sorted(need, key=order.__getitem__):
        anchor.prepend(n)
    return True


def _fold_local_write(graph: fx.Graph, op: fx.Node, order: dict[fx.Node, int]) -> bool:
    """cache_write(cat([kv_c, k_pe], -1), cache, slots) of the op's own latent -> the op writes it."""
    kv_c, k_pe = _output(op, 2), _output(op, 3)
    if kv_c is None or k_pe is None:
        return False
    for cat in list(kv_c.users):
        if _cat_pair(cat) != (kv_c, k_pe) or len(cat.users) != 1:
            continue
        write = next(iter(cat.users))
        if not _fn(write, cp.cache_write.default, cp.cache_write) or write.args[0] is not cat:
            continue
        cache, slots = write.args[1], write.args[2]
        if not _hoist_before(graph, slots, op, order):
            return False
        args = list(op.args)
        args[15], args[16] = cache, slots
        op.args = tuple(args)
        graph.erase_node(write)
        graph.erase_node(cat)
        return True
    return False


def _fold_attention_write(graph: fx.Graph, op: fx.Node, causal: dict[tuple[fx.Node, ...], fx.Node]) -> bool:
    """One device: the attention op's write moves into the op; the attention becomes its no-write twin."""
    outs = [_output(op, i) for i in range(4)]
    attn = next((u for u in (outs[0].users if outs[0] is not None else ()) if _fn(u, *_ATTENTION)), None)
    if attn is None or list(attn.args[:4]) != outs:
        return False
    cache, slots, block_table, seq_lens, qsl = attn.args[4:9]
    args = list(op.args)
    args[15], args[16] = cache, slots
    op.args = tuple(args)
    with graph.inserting_before(attn):
        if _fn(attn, cp.mla_attention.default, cp.mla_attention):
            key = (slots, qsl, seq_lens)
            if key not in causal:  # once per graph: causal key counts pos + 1 (dcp = 1 localisation)
                with graph.inserting_after(max(key, key=_order(graph).__getitem__)):
                    meta = graph.call_function(cp.dcp_localize_metadata.default, (slots, qsl, seq_lens, 1, 0, 1, 1))
                with graph.inserting_after(meta):
                    causal[key] = graph.call_function(operator.getitem, (meta, 2))
            part = graph.call_function(cp.mla_partial_attention.default,
                                       (outs[0], outs[1], cache, block_table, qsl, causal[key], attn.args[9]))
        else:
            part = graph.call_function(cp.sparse_mla_partial_attention.default,
                                       (outs[0], outs[1], cache, block_table, qsl, attn.args[9], attn.args[10]))
        out = graph.call_function(operator.getitem, (part, 0))
    attn.replace_all_uses_with(out)
    graph.erase_node(attn)
    return True


class MLAPreprocessCacheWritePass(_MLAPOStage):
    """Fold the latent cache write of each `cp::mla_preprocess` into the op."""

    name = "mla_preprocess_cache_write"

    def __call__(self, gm: fx.GraphModule) -> int:
        graph = gm.graph
        count = 0
        causal: dict[tuple[fx.Node, ...], fx.Node] = {}
        for op in [n for n in graph.nodes if _fn(n, *_PREPROCESS)]:
            if op.args[15] is not None:
                continue
            if _fold_local_write(graph, op, _order(graph)) or _fold_attention_write(graph, op, causal):
                count += 1
        if count:
            graph.lint()
            gm.recompile()
        return count
