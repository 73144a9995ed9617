"""The DSA-CP o_proj path on gloo ranks (tp = 2, enable_dsa_cp): compiled pass and eager switch.

1. The SFA example model (tiny HF DeepSeek-V3.2 weights), compiled (aot_eager: the
   pass's graph is what is tested; Inductor adds nothing here) with enable_dsa_cp,
   through `examples.serving.tiny_schedule` (prefill, decodes, a mixed step where a
   request joins, a request leaving, padding tokens): logits (1e-4) and greedy
   tokens equal the single-device eager model. No o_proj role is declared: the pass
   infers each layer's o_proj (and must not take the MLP's down projection). The
   prefill graph has each layer's linear + all-reduce replaced by the full-weight
   path; the decode graph is not touched, and neither graph recompiles. Storage:
   after every step, and after an exception raised inside the compiled prefill graph
   at layer 1's full-weight matmul, every o_proj parameter is the same object, with
   the same data_ptr, shape and values, and the rewritten graph holds no full-weight tensor except as an intermediate of the
   step (no get_attr, no graph output, users only the gather's wait and the matmul).
2. Eager (`cp_compile.runtime.o_proj_full_weight.OProjFullWeight`, same world): the float
   model through the same schedule == one device; W8A8 dynamic / static models with
   the switch == the same models without it (row-parallel TP), bit for bit. After
   every step and after an exception injected inside a layer's switch window, every
   o_proj parameter is the same object with the same data_ptr, shape and values and
   no forward override is left; the buffer pool holds one buffer per input-sharded
   parameter name (not per layer), reused (same data_ptr) from step to step.
3. (slow) A W8A8 (dynamic, static) o_proj declared with `compile_model(o_proj=...)`:
   the compiled prefill graph's output equals the eager row-parallel TP module bit
   for bit; a declared o_proj that is not row-parallel is refused with a ConfigError.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import cp_compile
from cp_compile.runtime import o_proj_full_weight as ofw
from cp_compile.base.config import AttentionSpec, ConfigError, CPConfig
from cp_compile.ops.parallel.o_proj import INPUT_SHARDED
from cp_compile.runtime.metadata_build import BlockAllocator, build_attention_metadata
from cp_compile.passes import o_proj_dsa_cp as pass_module
from cp_compile.passes.fx_utils import fake_value
from cp_compile.testing.multirank import run_on_ranks
from examples.models.deepseek_sfa import DeepseekSFAConfig, DeepseekSFAModel
from examples.models.quant import W8A8Config, W8A8RowParallelLinear
from examples.models.tiny import VOCAB, example_from_config, hf_deepseek_sfa
from examples.serving import layer_caches, run_schedule, tiny_schedule

BLOCK, NUM_BLOCKS, STEPS = 4, 12, 6


def _count(hist: dict[str, int], needle: str) -> int:
    return sum(v for k, v in hist.items() if needle in k)


def _record_graphs(store: list) -> None:
    """Wrap the pass so each rewritten graph leaves a summary of its full-weight-size tensors."""
    original = pass_module.OProjDSACPPass.__call__

    def call(self, gm):
        n = original(self, gm)
        # Full o_proj weight shapes: each 2-D parameter placeholder with its input dim x tp.
        full_shapes = set()
        for node in gm.graph.nodes:
            v = fake_value(node)
            if node.op == "placeholder" and isinstance(v, torch.Tensor) and v.dim() == 2 \
                    and all(isinstance(d, int) for d in v.shape):
                out_dim, in_dim = v.shape if v.dtype.is_floating_point else v.shape[::-1]
                full_shapes |= {(out_dim, in_dim * self.shards.tp.size), (in_dim * self.shards.tp.size, out_dim)}
        full = []
        for node in gm.graph.nodes:
            v = fake_value(node)
            if node.op != "placeholder" and isinstance(v, torch.Tensor) and v.dim() == 2 \
                    and all(isinstance(d, int) for d in v.shape) and tuple(v.shape) in full_shapes:
                full.append(dict(op=node.op, target=str(node.target),
                                 users=sorted(str(getattr(u.target, "__name__", u.target)) for u in node.users)))
        outs = gm.graph.output_node().args[0]
        outs = outs if isinstance(outs, (tuple, list)) else (outs,)
        store.append(dict(rewrites=n, full=full, full_shapes=sorted(full_shapes),
                          get_attr=[str(x.target) for x in gm.graph.nodes if x.op == "get_attr"],
                          output_shapes=[tuple(d if isinstance(d, int) else str(d) for d in fake_value(o).shape) for o in outs
                                         if isinstance(o, torch.fx.Node) and isinstance(fake_value(o), torch.Tensor)],
                          own_tensors=len(list(gm.parameters())) + len(list(gm.buffers()))))
        return n

    pass_module.OProjDSACPPass.__call__ = call


def _snapshot(model: nn.Module) -> dict[str, tuple]:
    return {n: (id(p), p.data_ptr(), tuple(p.shape), p.detach().clone())
            for n, p in model.named_parameters() if ".o_proj." in n}


def _same(before: dict, model: nn.Module) -> bool:
    now = dict(model.named_parameters())
    return all(id(now[n]) == i and now[n].data_ptr() == ptr and tuple(now[n].shape) == shp
               and torch.equal(now[n], val) for n, (i, ptr, shp, val) in before.items())


def _sfa_world(rank: int, world: int, hf_config, state_dict) -> dict:
    cfg = CPConfig(tensor_parallel_size=world, block_size=BLOCK, enable_dsa_cp=True)
    state = cp_compile.init_parallel(cfg, device="cpu")
    graphs: list = []
    _record_graphs(graphs)
    _run_compiled_graphs_under(_RUNTIME_MODE)
    model = example_from_config(hf_config, state_dict, world, state.layout.tp.rank, state.tp_group)
    cache = cp_compile.allocate_kv_cache(cfg, model.kv_cache_spec(), NUM_BLOCKS, attention=model.attention_spec())
    compiled = cp_compile.compile_model(model, lowering="aot_eager")
    before = _snapshot(model)
    intact: list[bool] = []
    res = run_schedule(compiled, layer_caches(cache), cfg, NUM_BLOCKS, tiny_schedule(VOCAB, num_steps=STEPS),
                       on_step=lambda step, meta: intact.append(_same(before, model)))
    hist = {str(k): [(h.name, h.rewrites, h.before, h.after) for pm in b.pass_managers for h in pm.history]
            for k, b in compiled.backends.items()}
    counts = {str(k): len(b.pass_managers) for k, b in compiled.backends.items()}
    # An exception raised inside the compiled prefill graph, at layer 1's full-weight
    # matmul (after its gathers, before its output gather; the same point on every rank).
    # Two requests (a batch of one would specialise the batch dim and recompile).
    meta = build_attention_metadata([(0, 4), (0, 3)], BlockAllocator(NUM_BLOCKS, cfg.virtual_block_size),
                                    max_blocks_per_req=8)
    o_in = hf_config.num_attention_heads * hf_config.v_head_dim
    _register_hop_passthrough()
    _RUNTIME_MODE.append(_FailAt(lambda f, a: f is torch.ops.aten.mm.default
                                 and tuple(a[1].shape) == (o_in, hf_config.hidden_size), nth=2))
    try:
        with torch.no_grad():
            compiled(torch.arange(7), meta.positions, layer_caches(cache), meta)
        compiled_raised = None
    except RuntimeError as e:
        compiled_raised = str(e)
    finally:
        _RUNTIME_MODE.clear()
    intact.append(_same(before, model))
    counts_after = {str(k): len(b.pass_managers) for k, b in compiled.backends.items()}
    eager = {kind: _eager_run(cfg, state, hf_config, state_dict, q) for kind, q in QUANTS.items()}
    return dict(results=res, hist=hist, intact=intact, graphs=graphs, eager=eager, counts=counts,
                counts_after=counts_after, compiled_raised=compiled_raised)


_RUNTIME_MODE: list = []  # a dispatch mode to run the compiled graphs under (set by the test, in a rank)


def _run_compiled_graphs_under(modes: list) -> None:
    """Wrap the backend's lowering so its compiled graphs run under modes[0] when set: a
    dispatch mode active at the call would instead stop Dynamo from compiling the frame."""
    import importlib

    backend = importlib.import_module("cp_compile.compiler.backend")  # the module (cp_compile.backend is also a function)
    original = backend.lower

    def lower(*args, **kwargs):
        fn = original(*args, **kwargs)

        def run(*a):
            if not modes:
                return fn(*a)
            with modes[0]:
                return fn(*a)
        return run

    backend.lower = lower


class _FailAt(TorchDispatchMode):
    """Raises at the nth op call matching `pred(func, args)` (counted while active)."""

    def __init__(self, pred, nth: int) -> None:
        super().__init__()
        self.pred, self.nth, self.seen = pred, nth, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.pred(func, args):
            self.seen += 1
            if self.seen == self.nth:
                raise RuntimeError(f"injected at call {self.nth} of {func}")
        return func(*args, **(kwargs or {}))


def _register_hop_passthrough() -> None:
    """Let the cache writes' auto_functionalized_v2 run through `_FailAt` untouched."""
    from torch._higher_order_ops.auto_functionalize import auto_functionalized_v2

    @auto_functionalized_v2.py_impl(_FailAt)
    def _(mode, *args, **kwargs):
        return auto_functionalized_v2(*args, **kwargs)  # the mode is already off the stack here


QUANTS = {"linear": None, "w8a8_dynamic": W8A8Config("dynamic"),
          "w8a8_static": W8A8Config("static", input_scales=(0.05, 0.08), input_offsets=(2, -3))}


def _sfa_model(hf_config, state_dict, tp: int, rank: int, group, quant):
    cfg = DeepseekSFAConfig.from_hf(hf_config)
    cfg.o_proj_quant = quant
    model = DeepseekSFAModel(cfg, tp, rank, group)
    model.load_hf_state_dict(state_dict)
    return model.eval()


def _eager_run(cfg: CPConfig, state, hf_config, state_dict, quant) -> dict:
    """One schedule with the eager full-weight switch, one without (TP), one injected failure."""
    model = _sfa_model(hf_config, state_dict, cfg.tensor_parallel_size, state.layout.tp.rank, state.tp_group, quant)
    fw = ofw.OProjFullWeight(model)
    before = _snapshot(model)
    intact, pool_ptrs = [], []

    def forward(ids, positions, kv, meta):
        with fw.for_step(meta):
            return model(ids, positions, kv, meta)

    def after_step(step, meta):
        intact.append(_same(before, model) and not any("forward" in m.__dict__ for m in fw.modules))
        pool_ptrs.append(sorted(t.data_ptr() for t in fw.pool.values()))

    runs = {}
    for name, fn in (("full_weight", forward), ("tp", model)):
        cache = cp_compile.allocate_kv_cache(cfg, model.kv_cache_spec(), NUM_BLOCKS, attention=model.attention_spec())
        runs[name] = run_schedule(fn, layer_caches(cache), cfg, NUM_BLOCKS, tiny_schedule(VOCAB, num_steps=STEPS),
                                  on_step=after_step if name == "full_weight" else None)
    # An exception inside layer 1's switch window (its parameters point at the full buffers).
    calls, real = [0], ofw.full_linear

    def failing(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 2:
            raise RuntimeError("injected")
        return real(*args, **kwargs)

    ofw.full_linear = failing
    meta = build_attention_metadata([(0, 6)], BlockAllocator(NUM_BLOCKS, BLOCK))
    cache = cp_compile.allocate_kv_cache(cfg, model.kv_cache_spec(), NUM_BLOCKS, attention=model.attention_spec())
    try:
        forward(torch.arange(6), meta.positions, layer_caches(cache), meta)
        raised = None
    except RuntimeError as e:
        raised = str(e)
    finally:
        ofw.full_linear = real
    kind = ofw.linear_kind(fw.modules[0])
    return dict(runs=runs, intact=intact, pool_ptrs=pool_ptrs, raised=raised, calls=calls[0],
                intact_after_raise=_same(before, model) and not any("forward" in m.__dict__ for m in fw.modules),
                pool_keys=[k[0] for k in fw.pool], pool_bytes=fw.pool_bytes(), kind=kind,
                want_pool_bytes=sum(p.numel() * p.element_size() * cfg.tensor_parallel_size for n, p in
                                    fw.modules[0].named_parameters() if n in dict(INPUT_SHARDED[kind])),
                layers=len(fw.modules))


def _reference(hf_config, state_dict):
    model = example_from_config(hf_config, state_dict)
    cfg = CPConfig(block_size=BLOCK)
    cache = cp_compile.allocate_kv_cache(cfg, model.kv_cache_spec(), NUM_BLOCKS)
    return run_schedule(model, layer_caches(cache), cfg, NUM_BLOCKS, tiny_schedule(VOCAB, num_steps=STEPS))


@pytest.fixture(scope="module")
def sfa_world():
    hf = hf_deepseek_sfa("deepseek_v32", num_heads=4)
    sd = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    per_rank = run_on_ranks(_sfa_world, 2, hf.config, sd, timeout=900)
    return per_rank, _reference(hf.config, sd), hf.config.num_hidden_layers


def test_compiled_sfa_model_with_full_weight_o_proj_matches_single_device(sfa_world):
    per_rank, ref, layers = sfa_world
    worst = 0.0
    for rank, out in enumerate(per_rank):
        for step, (got, want) in enumerate(zip(out["results"], ref, strict=True)):
            torch.testing.assert_close(got.last_logits, want.last_logits, atol=1e-4, rtol=1e-4,
                                       msg=lambda m: f"rank {rank} step {step}: {m}")
            assert got.next_tokens == want.next_tokens, (rank, step)
            worst = max(worst, (got.last_logits - want.last_logits).abs().max().item())
        # After every step and after the exception injected inside the compiled graph.
        assert out["compiled_raised"] is not None and "injected at call 2" in out["compiled_raised"]
        assert out["intact"] == [True] * (STEPS + 1), out["intact"]
        # One graph per batch kind for prefills of T = 12 and 9 and decodes: the rewrite
        # added no guard on T (a baked SymInt or a pad-is-zero guard would recompile).
        assert out["counts"] == out["counts_after"] == {"decode": 1, "prefill": 1}, out["counts"]
        # Decode graph: the row-parallel o_proj as written (no o_proj pass ran).
        assert all(name != "o_proj_dsa_cp" for name, *_ in out["hist"]["decode"])
        (rewrites, before, after), = [(r, b, a) for n, r, b, a in out["hist"]["prefill"] if n == "o_proj_dsa_cp"]
        assert rewrites == layers  # each layer's o_proj; the MLP down projections are kept
        assert _count(before, "all_reduce") - _count(after, "all_reduce") == layers
        assert _count(after, "all_reduce") == layers  # the MLPs' all-reduces
        assert _count(after, "all_gather_into_tensor") - _count(before, "all_gather_into_tensor") == 2 * layers
        assert _count(after, "all_to_all_single") - _count(before, "all_to_all_single") == layers
        (g,) = out["graphs"]
        assert g["rewrites"] == layers and g["get_attr"] == [] and g["own_tensors"] == 0
        # Full-weight tensors: per layer the gather and its wait, consumed only by the matmul.
        assert len(g["full"]) == 2 * layers, g
        for f in g["full"]:
            assert f["op"] == "call_function" and f["users"] in (["wait_tensor.default"], ["mm"]), f
        assert all(s not in g["full_shapes"] for s in g["output_shapes"])
    print(f"\nDSA-CP o_proj (tp 2, aot_eager, {STEPS} steps): max |logit diff| vs one device {worst:.2e}, "
          f"tokens equal")


def test_eager_full_weight_switch_matches_and_restores_the_tp_parameters(sfa_world):
    per_rank, ref, layers = sfa_world
    worst = 0.0
    for rank, out in enumerate(per_rank):
        for kind, e in out["eager"].items():
            where = f"rank {rank} {kind}"
            full, tp = e["runs"]["full_weight"], e["runs"]["tp"]
            for step, (got, want) in enumerate(zip(full, tp, strict=True)):
                if kind == "linear":
                    torch.testing.assert_close(got.last_logits, ref[step].last_logits, atol=1e-4, rtol=1e-4)
                    assert got.next_tokens == ref[step].next_tokens, (where, step)
                    worst = max(worst, (got.last_logits - ref[step].last_logits).abs().max().item())
                else:  # W8A8: the full-weight path is the TP path's arithmetic, bit for bit
                    assert torch.equal(got.last_logits, want.last_logits), (where, step)
            # Storage: parameters untouched after every step and after the injected failure.
            assert e["intact"] == [True] * STEPS, (where, e["intact"])
            assert e["raised"] == "injected" and e["calls"] == 2 and e["intact_after_raise"], where
            # Pool: one buffer per input-sharded parameter (not per layer), reused every step.
            assert sorted(e["pool_keys"]) == sorted(n for n, _ in INPUT_SHARDED[kind]) and e["layers"] == layers
            assert all(p == e["pool_ptrs"][0] for p in e["pool_ptrs"]) and e["pool_ptrs"][0], where
            assert e["pool_bytes"] == e["want_pool_bytes"], where
    print(f"\neager full-weight o_proj (tp 2): float max |logit diff| vs one device {worst:.2e}; W8A8 dynamic / "
          f"static bitwise == TP; pool bytes " + ", ".join(f"{k} {e['pool_bytes']}" for k, e in
                                                           per_rank[0]["eager"].items()))


# --------------------------------------------------------------------------- W8A8, declared role

IN, OUT, HEADS = 32, 24, 4


class QuantAttnOut(nn.Module):
    """x -> (stand-in attention) -> W8A8 row-parallel o_proj, to test the pass on quantised linears."""

    def __init__(self, quant: W8A8Config, tp: int, rank: int, group) -> None:
        super().__init__()
        self.o_proj = W8A8RowParallelLinear(IN, OUT, tp, rank, tp_group=group, quant=quant)
        self.other = nn.Linear(OUT, OUT)

    def attention_spec(self) -> AttentionSpec:
        return AttentionSpec("sfa", HEADS, has_indexer=True)

    def forward(self, x: torch.Tensor, meta: cp_compile.AttentionMetadata) -> torch.Tensor:
        return self.other(self.o_proj(x))


def _quant_world(rank: int, world: int) -> dict:
    cfg = CPConfig(tensor_parallel_size=world, block_size=BLOCK, enable_dsa_cp=True)
    state = cp_compile.init_parallel(cfg, device="cpu")
    g = torch.Generator().manual_seed(0)
    W = torch.randn(OUT, IN, generator=g) / IN ** 0.5
    k = IN // world
    out = {}
    for name, q in (("dynamic", W8A8Config("dynamic")),
                    ("static", W8A8Config("static", input_scales=(0.03, 0.05), input_offsets=(1, -4)))):
        torch._dynamo.reset()
        torch.manual_seed(1)
        m = QuantAttnOut(q, world, state.layout.tp.rank, state.tp_group)
        m.o_proj.load_full(W)
        compiled = cp_compile.compile_model(m, lowering="aot_eager", dynamic_args=("x",), o_proj="o_proj")
        before = _snapshot_all(m.o_proj)
        for T, reqs in ((7, [(0, 5), (2, 2)]), (9, [(0, 9)]), (2, [(3, 1), (5, 1)])):
            meta = build_attention_metadata(reqs, BlockAllocator(8, BLOCK))
            x = torch.randn(T, IN, generator=g)[:, state.layout.tp.rank * k:(state.layout.tp.rank + 1) * k].contiguous()
            with torch.no_grad():
                out[(name, T)] = torch.equal(compiled(x, meta), m(x, meta))
        out[(name, "intact")] = _same_all(before, m.o_proj)
        out[(name, "hist")] = {str(kd): [(h.name, h.rewrites, h.after) for pm in b.pass_managers for h in pm.history]
                               for kd, b in compiled.backends.items()}
    # A declared o_proj that is no row-parallel linear: refused at compile time, naming it.
    torch._dynamo.reset()
    bad = cp_compile.compile_model(QuantAttnOut(W8A8Config("dynamic"), world, state.layout.tp.rank, state.tp_group),
                                   lowering="aot_eager", dynamic_args=("x",), o_proj="other")
    try:
        bad(torch.randn(5, k), build_attention_metadata([(0, 5)], BlockAllocator(8, BLOCK)))
        out["refusal"] = None
    except ConfigError as e:
        out["refusal"] = str(e)
    return out


def _snapshot_all(m: nn.Module) -> dict:
    return {n: (id(p), p.data_ptr(), tuple(p.shape), p.detach().clone()) for n, p in m.named_parameters()}


def _same_all(before: dict, m: nn.Module) -> bool:
    now = dict(m.named_parameters())
    return all(id(now[n]) == i and now[n].data_ptr() == ptr and tuple(now[n].shape) == s and torch.equal(now[n], v)
               for n, (i, ptr, s, v) in before.items())


@pytest.mark.slow
def test_w8a8_o_proj_compiled_full_weight_is_bitwise_the_tp_o_proj():
    for rank, out in enumerate(run_on_ranks(_quant_world, 2, timeout=600)):
        for mode in ("dynamic", "static"):
            assert all(out[(mode, T)] for T in (7, 9, 2)), (rank, mode, out)
            assert out[(mode, "intact")]
            hist = out[(mode, "hist")]
            (rewrites, after), = [(r, a) for n, r, a in hist["prefill"] if n == "o_proj_dsa_cp"]
            assert rewrites == 1 and _count(after, "all_reduce") == 0
            assert _count(after, f"cp.w8a8_{mode}_linear") == 1
            # dynamic: the int8 weight only; static: weight + scale, offset, quant bias, dequant scale.
            assert _count(after, "all_gather_into_tensor") == (2 if mode == "dynamic" else 6)
            assert all(n != "o_proj_dsa_cp" for n, *_ in hist["decode"])
        assert out["refusal"] is not None and "o_proj='other'" in out["refusal"] and "other.weight" in out["refusal"]
