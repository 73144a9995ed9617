"""The pass pipeline in one process: which passes a context enables, what each rewrites.

Graph structure only (op histograms before and after every pass, on Dynamo graphs
captured from small models that call the single-device ops). Numerics of the
rewritten graphs are checked on real gloo ranks in test_compiled_dcp_model.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import cp_compile
from cp_compile.base.config import AttentionSpec, ConfigError, CPConfig
from cp_compile.passes.context import CompileContext, resolve_roles
from cp_compile.runtime.metadata_build import BlockAllocator, build_attention_metadata
from cp_compile.passes import pass_manager
from cp_compile.passes.base import CPPass
from cp_compile.passes.fx_utils import fake_value, parameter_fqn
from cp_compile.testing.multirank import run_on_ranks
from cp_compile.testing.pass_harness import capture_graph, run_pipeline

LAYERS = 2
H, D, L, R, K = 4, 8, 16, 4, 3  # query heads, GQA head dim, MLA latent / rope dims, top-k
DI = 8  # indexer key dim
BLOCK, NUM_BLOCKS = 4, 8
cp = torch.ops.cp


class Attn(nn.Module):
    """`LAYERS` layers of one single-device attention op between two linears."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        width = H * (L if kind != "gqa" else D)
        self.q_proj = nn.ModuleList(nn.Linear(width, width) for _ in range(LAYERS))
        self.o_proj = nn.ModuleList(nn.Linear(width, width) for _ in range(LAYERS))

    def forward(self, x: torch.Tensor, caches: list[torch.Tensor], meta: cp_compile.AttentionMetadata):
        args = (meta.slot_mapping, meta.block_table, meta.seq_lens, meta.query_start_loc)
        T = x.shape[0]
        for i in range(LAYERS):
            q = self.q_proj[i](x).view(T, H, -1)
            if self.kind == "gqa":
                o = cp.gqa_paged_attention(q, q[:, :1], q[:, :1], caches[2 * i], caches[2 * i + 1], *args, 0.5)
            elif self.kind == "mla":
                o = cp.mla_attention(q, q[..., :R], q[:, 0], q[:, 0, :R], caches[i], *args, 0.5)
            else:  # indexer over its own cache (caches[LAYERS + i]), then sparse MLA over its top-k
                idx = cp.lightning_indexer(q[..., :DI], q[:, 0, :DI], q[:, :, 0], caches[LAYERS + i], *args, K)
                o = cp.sparse_mla_attention(q, q[..., :R], q[:, 0], q[:, 0, :R], caches[i], *args, idx, 0.5)
            x = self.o_proj[i](o.reshape(T, -1))
        return x


def _inputs(kind: str, index_page: int = BLOCK):
    """index_page: tokens per page of the indexer caches (replicated under SFA DCP:
    BLOCK * dcp, like the single-device caches of the same metadata)."""
    meta = build_attention_metadata([(0, 3), (0, 2)], BlockAllocator(NUM_BLOCKS, BLOCK))
    if kind == "gqa":
        caches = [torch.zeros(NUM_BLOCKS, BLOCK, 1, D) for _ in range(2 * LAYERS)]
    else:
        caches = [torch.zeros(NUM_BLOCKS, BLOCK, L + R) for _ in range(LAYERS)]
    if kind == "sfa":
        caches += [torch.zeros(NUM_BLOCKS, index_page, DI) for _ in range(LAYERS)]
    width = H * (L if kind != "gqa" else D)
    return torch.randn(meta.num_tokens, width), caches, meta


def _ctx(kind: str, dcp: int, merge: str = "ag_rs", tp: int = 4, pcp: int = 1) -> CompileContext:
    spec = AttentionSpec(kind=kind, num_heads=4 * H, num_kv_heads=1, has_indexer=kind == "sfa")
    cfg = CPConfig(tensor_parallel_size=tp, decode_context_parallel_size=dcp, prefill_context_parallel_size=pcp,
                   block_size=BLOCK, dcp_merge=merge)
    return CompileContext.for_test(cfg, attention=spec)


OPS = {"gqa": "cp.gqa_paged_attention", "mla": "cp.mla_attention", "sfa": "cp.sparse_mla_attention"}


@pytest.mark.parametrize("kind", ["gqa", "mla", "sfa"])
@pytest.mark.parametrize("dcp,merge", [(1, "ag_rs"), (2, "ag_rs"), (2, "a2a"), (4, "ag_rs"), (4, "a2a")])
def test_pipeline_histograms(kind, dcp, merge):
    tp = dcp if kind == "sfa" else 4  # SFA DCP needs dcp == tp
    pm, gm = run_pipeline(Attn(kind), _inputs(kind, BLOCK * dcp), _ctx(kind, dcp, merge, tp=tp))
    op = OPS[kind]  # Dynamo records the packet
    if dcp == 1:  # nothing sharded: no pass runs, the single-device ops stay
        assert pm.names == [] and pm.history == []
        return
    rewriter = "sfa_dcp" if kind == "sfa" else "dcp_attention"
    expected = ["dcp_attention", "sfa_dcp", "unsharded_attention_check"] if kind == "sfa" else \
        ["dcp_attention", "unsharded_attention_check"]
    assert pm.names == expected
    rec = {h.name: h for h in pm.history}
    dcp_rec, check_rec = rec[rewriter], rec["unsharded_attention_check"]
    before, after = dcp_rec.before, dcp_rec.after
    assert dcp_rec.rewrites == LAYERS and before[op] == LAYERS and op not in after
    assert check_rec.rewrites == 0 and check_rec.before == check_rec.after == after
    assert after["cp.dcp_localize_metadata.default"] == 1  # once per graph, shared by the layers
    q_gathers = 1  # GQA gathers q; MLA and SFA one fused [q_nope | q_pe]
    writes = 2 if kind == "gqa" else 1
    if kind == "sfa":  # the indexer stays (replicated cache), its top-k remapped per layer
        assert after["cp.lightning_indexer"] == LAYERS
        assert after["cp.dcp_sparse_indices.default"] == LAYERS
        assert rec["dcp_attention"].rewrites == 0
    assert after["cp.cache_write.default"] == writes * LAYERS
    gathers = after["_c10d_functional.all_gather_into_tensor.default"]
    if merge == "ag_rs":
        assert gathers == LAYERS * (q_gathers + 1)  # + the LSE gather
        assert after["_c10d_functional.reduce_scatter_tensor.default"] == LAYERS
        assert after["cp.lse_rescale.default"] == LAYERS
    else:
        assert gathers == LAYERS * q_gathers
        assert after["_c10d_functional.all_to_all_single.default"] == LAYERS
        assert after["cp.lse_combine.default"] == LAYERS
    waits = after["_c10d_functional.wait_tensor.default"]
    assert waits == gathers + LAYERS  # every collective is waited on
    # Every node the pass created has a fake value, so a later pass can read its shape.
    missing = [n.name for n in gm.graph.nodes if n.op in ("call_function", "call_method")
               and "example_value" not in n.meta]
    assert missing == []
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    out = out[0] if isinstance(out, (tuple, list)) else out
    assert tuple(fake_value(out).shape[1:]) == (H * (D if kind == "gqa" else L),)


def test_pipeline_is_configured_by_the_context():
    names = lambda **kw: pass_manager.PassManager.for_context(_ctx("gqa", **kw)).names  # noqa: E731
    assert names(dcp=1) == []
    assert names(dcp=2) == ["dcp_attention", "unsharded_attention_check"]
    assert pass_manager.PassManager.for_context(_ctx("sfa", dcp=2, tp=2)).names == \
        ["dcp_attention", "sfa_dcp", "unsharded_attention_check"]
    # PCP: prefill graphs are token-sharded by pcp_attention, decode graphs run dcp_attention over the
    # pcp * dcp ranks of the cache; a graph for every kind gets pcp_attention, which refuses it.
    spec = AttentionSpec(kind="gqa", num_heads=4 * H, num_kv_heads=1)
    for dcp in (1, 2):
        cfg = CPConfig(tensor_parallel_size=2, decode_context_parallel_size=dcp, prefill_context_parallel_size=2,
                       block_size=BLOCK)
        by_kind = {k: pass_manager.PassManager.for_context(CompileContext.for_test(cfg, attention=spec,
                                                                                   batch_kind=k)).names
                   for k in (None, "decode", "prefill", "verify", "fresh_prefill")}
        assert by_kind == {None: ["pcp_attention", "unsharded_attention_check"],
                           "decode": ["dcp_attention", "unsharded_attention_check"],
                           "verify": ["dcp_attention", "unsharded_attention_check"],  # decode-like (speculation)
                           "prefill": ["pcp_attention", "unsharded_attention_check"],
                           "fresh_prefill": ["pcp_attention", "unsharded_attention_check"]}  # no context part


def test_sparse_attention_under_dcp_is_refused_in_process():
    # A model whose spec does not declare its indexer: no pass may claim the sparse ops.
    ctx = CompileContext.for_test(CPConfig(tensor_parallel_size=2, decode_context_parallel_size=2,
                                           block_size=BLOCK), attention=AttentionSpec(kind="mla", num_heads=8))
    with pytest.raises(ConfigError, match=r"cp::sparse_mla_attention left in the graph.*"
                                          r"decode_context_parallel_size=2.*attention kind=mla.*"
                                          r"supported by the sfa_dcp pass \(enabled when .*'sfa'"):
        run_pipeline(Attn("sfa"), _inputs("sfa", 2 * BLOCK), ctx)


def test_sfa_dcp_refuses_a_sharded_indexer_cache():
    # The indexer must read a replicated cache (pages of BLOCK * dcp): with the latent's
    # sharded page size its top-k would see half the tokens.
    with pytest.raises(ConfigError, match=r"pages of 4 tokens; SFA DCP needs block_size \* "
                                          r"decode_context_parallel_size = 8"):
        run_pipeline(Attn("sfa"), _inputs("sfa", BLOCK), _ctx("sfa", dcp=2, tp=2))


def test_gqa_under_pcp_needs_the_compiled_entry():
    # One graph for every batch kind cannot be token-sharded (the compiled entry shards prefill steps).
    with pytest.raises(ConfigError, match=r"PCP prefill graphs come from the compiled entry.*"
                                          r"prefill_context_parallel_size=2.*compile_model"):
        run_pipeline(Attn("gqa"), _inputs("gqa"), _ctx("gqa", dcp=1, tp=2, pcp=2))


def test_graph_dumps(tmp_path, monkeypatch):
    monkeypatch.setenv("CP_COMPILE_DUMP_GRAPHS", str(tmp_path))
    run_pipeline(Attn("gqa"), _inputs("gqa"), _ctx("gqa", dcp=2))
    dumps = sorted(p.name.split("-", 1)[1] for p in tmp_path.iterdir())
    assert dumps == ["00-dcp_attention-after.txt", "00-dcp_attention-before.txt",
                     "01-unsharded_attention_check-after.txt", "01-unsharded_attention_check-before.txt"]
    before = next(tmp_path.glob("*-00-dcp_attention-before.txt")).read_text()
    after = next(tmp_path.glob("*-00-dcp_attention-after.txt")).read_text()
    assert "cp.gqa_paged_attention" in before and "cp.gqa_paged_attention" not in after
    assert "all_gather_into_tensor" in after


# --------------------------------------------------------------------------- roles reach the passes


class RoleProbe(CPPass):
    """Records what a pass sees: the roles in its context, and the role of every
    parameter placeholder of the graph."""

    name = "role_probe"
    enabled_when = "always (test only)"
    seen: list[dict] = []

    @classmethod
    def is_enabled(cls, ctx: CompileContext) -> bool:
        return True

    def __call__(self, gm: torch.fx.GraphModule) -> int:
        params = {parameter_fqn(n): self.ctx.role_of_parameter(parameter_fqn(n))
                  for n in gm.graph.nodes if parameter_fqn(n) is not None}
        RoleProbe.seen.append(dict(roles=self.ctx.roles, params=params))
        return 0


def test_declared_roles_reach_the_passes(monkeypatch):
    monkeypatch.setattr(pass_manager, "PIPELINE", (RoleProbe,))
    RoleProbe.seen.clear()

    @cp_compile.cp_module(o_proj="o_proj", lowering="eager", dynamic_args=("x",))
    class Model(Attn):
        pass

    m = Model("gqa")
    x, caches, meta = _inputs("gqa")
    torch.testing.assert_close(m(x, caches, meta), m.cp_eager_forward(x, caches, meta))
    (seen,) = RoleProbe.seen
    (role,) = seen["roles"]
    assert role.role == "o_proj" and role.modules == ("o_proj",)
    assert seen["params"] == {**{f"q_proj.{i}.{p}": None for i in range(LAYERS) for p in ("weight", "bias")},
                              **{f"o_proj.{i}.{p}": "o_proj" for i in range(LAYERS) for p in ("weight", "bias")}}
    assert m.cp_compiled.backend.contexts[0].roles == m.cp_roles


def test_roles_resolve_per_layer_and_refuse_unknown_names():
    (role,) = resolve_roles(Attn("gqa"), {"o_proj": "o_proj.1", "indexer": None})
    assert role.modules == ("o_proj.1",) and role.parameters == ("o_proj.1.weight", "o_proj.1.bias")
    with pytest.raises(ValueError, match=r"unknown roles \['q_proj'\]"):
        resolve_roles(Attn("gqa"), {"q_proj": "q_proj"})


def test_capture_runs_the_unmodified_graph():
    x, caches, meta = _inputs("gqa")
    gm = capture_graph(Attn("gqa"), x, caches, meta)
    assert any("gqa_paged_attention" in str(n.target) for n in gm.graph.nodes)
    assert caches[0].abs().sum() > 0  # the single-device op ran and wrote the cache


# --------------------------------------------------------------------------- the real backend, on ranks


class SparseModel(Attn):
    def attention_spec(self) -> AttentionSpec:
        # Declared as plain MLA so that only the graph check (not validate_for) can refuse it.
        return AttentionSpec(kind="mla", num_heads=2 * H)


def _refusals_at_dcp2(rank: int, world: int) -> dict[str, str]:
    cfg = CPConfig(tensor_parallel_size=2, decode_context_parallel_size=2, block_size=BLOCK)
    cp_compile.init_parallel(cfg, device="cpu")
    x, caches, meta = _inputs("sfa", 2 * BLOCK)
    before = [c.clone() for c in caches]
    seen: dict[str, str] = {}
    # 1. A plain torch.compile with the backend: the error is a ConfigError, not BackendCompilerFailed.
    compiled = torch.compile(SparseModel("sfa"), backend=cp_compile.backend(lowering="eager",
                                                                          attention=SparseModel("sfa")
                                                                          .attention_spec()), fullgraph=True)
    try:
        compiled(x, caches, meta)
    except ConfigError as e:
        seen["torch.compile"] = str(e)
    # 2. The same through compile_model (attention_spec read off the module).
    try:
        cp_compile.compile_model(SparseModel("sfa"), lowering="eager", dynamic_args=("x",))(x, caches, meta)
    except ConfigError as e:
        seen["compile_model"] = str(e)
    # 3. A model with no AttentionSpec cannot be compiled at dcp > 1.
    try:
        cp_compile.compile_model(Attn("gqa"), lowering="eager", dynamic_args=("x",))(*_inputs("gqa"))
    except ConfigError as e:
        seen["no spec"] = str(e)
    # 4. A spec the config cannot serve (2 KV heads at tp = 2, dcp = 2) fails before tracing.
    try:
        cp_compile.compile_model(Attn("gqa"), lowering="eager", dynamic_args=("x",),
                                 attention=AttentionSpec(kind="gqa", num_heads=8, num_kv_heads=2))(*_inputs("gqa"))
    except ConfigError as e:
        seen["bad spec"] = str(e)
    seen["caches unchanged"] = str(all(torch.equal(a, b) for a, b in zip(before, caches)))
    return seen


def test_unsupported_ops_and_models_fail_at_compile_time_on_ranks():
    for seen in run_on_ranks(_refusals_at_dcp2, 2):
        assert "cp::sparse_mla_attention" in seen["torch.compile"]
        assert "cp::sparse_mla_attention" in seen["compile_model"]
        assert "the model declares its attention" in seen["no spec"] and "attention_spec()" in seen["no spec"]
        assert "(tp // num_kv_heads) % dcp == 0" in seen["bad spec"]
        assert seen["caches unchanged"] == "True"  # refused before the graph ever ran


def test_passes_and_compositions_read_no_module_level_parallel_state():
    """Everything a pass or a composition knows comes from the CompileContext it is given."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    files = sorted([*(root / "passes").glob("*.py"), *(root / "ops" / "parallel").glob("*.py")])
    assert len(files) >= 7
    needles = ("parallel_state", "get_parallel_state", "_STATE", "torch.distributed", "import dist")
    offenders = [f"{f.relative_to(root)}: {n}" for f in files for n in needles if n in f.read_text()]
    assert offenders == []
