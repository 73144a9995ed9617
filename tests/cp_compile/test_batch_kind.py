"""One graph per batch kind (PCP, DSA-CP): the step's kind picks the graph, on the host."""

import pytest
import torch

import cp_compile
from cp_compile.runtime.metadata import batch_kind, is_fresh
from cp_compile.runtime.metadata_build import BlockAllocator, build_attention_metadata
from cp_compile.testing.batches import STEP_B, two_step_metas


def _meta(reqs: list[tuple[int, int]], padding: int = 2):
    return build_attention_metadata(reqs, BlockAllocator(32, 4), req_ids=list(range(len(reqs))),
                                    num_padding_tokens=padding)


def test_batch_kind_reads_query_lengths():
    assert batch_kind(_meta(STEP_B["decode"])) == "decode"
    assert batch_kind(_meta([(0, 1)], padding=0)) == "decode"
    for kind in ("mixed", "spec_decode"):
        assert batch_kind(_meta(STEP_B[kind])) == "prefill"
    assert batch_kind(_meta([(0, 7)])) == "prefill"


def test_is_fresh_reads_context_lengths():
    # PCP's fresh-step graph (issue 26): only when no request has cached context.
    assert is_fresh(_meta([(0, 7), (0, 3), (0, 1)]))  # prompts (a 1-token one too), batch padding
    assert is_fresh(_meta([(0, 5)], padding=0))
    assert not is_fresh(_meta([(0, 7), (4, 5)]))  # one chunk on a cached prefix: a mixed batch
    assert not is_fresh(_meta([(9, 1)]))  # decode
    assert not is_fresh(_meta(STEP_B["mixed"]))


def test_verify_kind_needs_speculation_and_at_most_k_plus_1_tokens():
    # Speculative verification: the last accepted token + k drafts per request (fewer near the end).
    verify = _meta([(9, 3), (4, 2), (7, 1)])
    assert batch_kind(verify) == "prefill"  # no speculation declared: a multi-token batch is prefill
    assert batch_kind(verify, num_speculative_tokens=2) == "verify"
    assert batch_kind(verify, num_speculative_tokens=1) == "prefill"  # 3 > k + 1 tokens
    assert batch_kind(_meta(STEP_B["decode"]), num_speculative_tokens=3) == "decode"


class Sparse(torch.nn.Module):
    """No attention op: the test is about which graph runs, not what it rewrites."""

    def attention_spec(self) -> cp_compile.AttentionSpec:
        return cp_compile.AttentionSpec("sfa", 4, has_indexer=True)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        return input_ids * 2 + positions + meta.seq_lens.sum()


def test_graph_per_batch_kind_compiles_two_graphs_and_never_recompiles():
    cfg = cp_compile.CPConfig(enable_dsa_cp=True, block_size=4)
    assert cfg.graph_per_batch_kind and not cp_compile.CPConfig().graph_per_batch_kind
    compiled = cp_compile.compile_model(Sparse(), config=cfg, lowering="eager")
    model = Sparse()
    steps = [m for batch in ("decode", "mixed") for m in two_step_metas(batch, dcp=1, block_size=4, num_blocks=32)]
    for i, meta in enumerate(steps + steps):
        if i == len(steps):  # every kind seen once, with its dynamic shapes: nothing may compile again
            torch.compiler.set_stance("fail_on_recompile")
        try:
            ids = torch.arange(meta.num_tokens)
            torch.testing.assert_close(compiled(ids, meta.positions, meta), model(ids, meta.positions, meta))
        finally:
            torch.compiler.set_stance("default")
    kinds = {k: [c.batch_kind for c in b.contexts] for k, b in compiled.backends.items()}
    assert kinds == {"decode": ["decode"], "prefill": ["prefill"]}


def test_first_step_of_a_kind_compiles_under_fail_on_recompile_and_a_recompile_still_fails():
    # Which kinds a warm-up meets depends on the batches (PCP: a fresh prompt, later a chunk on a prefix):
    # a kind's first step compiles its graph whatever the stance; a second compile of a graph is refused.
    cfg = cp_compile.CPConfig(enable_dsa_cp=True, block_size=4)
    compiled = cp_compile.compile_model(Sparse(), config=cfg, lowering="eager")
    metas = {batch: two_step_metas(batch, dcp=1, block_size=4, num_blocks=32)[1] for batch in ("decode", "mixed")}
    with torch.compiler.set_stance("fail_on_recompile"):
        for meta in metas.values():
            compiled(torch.arange(meta.num_tokens), meta.positions, meta)
        meta = metas["mixed"]
        with pytest.raises(RuntimeError, match="recompile"):  # float ids: a dtype guard fails
            compiled(torch.arange(meta.num_tokens, dtype=torch.float32), meta.positions, meta)
    assert {k: len(b.contexts) for k, b in compiled.backends.items()} == {"decode": 1, "prefill": 1}
    # Only fail_on_recompile is lifted for a first step: force_eager stays the caller's (nothing compiles).
    eager = cp_compile.compile_model(Sparse(), config=cfg, lowering="eager")
    with torch.compiler.set_stance("force_eager"):
        for meta in metas.values():
            eager(torch.arange(meta.num_tokens), meta.positions, meta)
    graphs = {k: len(b.contexts) for k, b in eager.backends.items()}
    assert graphs and set(graphs.values()) == {0}, graphs
    torch._dynamo.reset()  # Sparse.forward's cache entries count against the recompile limit of later tests


def test_speculation_adds_one_verify_graph_and_never_recompiles():
    # One graph for decode / prefill (dcp only) plus the verify graph; with DSA-CP three graphs.
    verify_metas = [build_attention_metadata(r, BlockAllocator(32, 4), num_padding_tokens=1)
                    for r in ([(5, 3), (9, 3)], [(6, 2), (12, 3)], [(8, 1), (15, 2), (3, 3)])]
    for cfg, want in ((cp_compile.CPConfig(block_size=4), [None, "verify"]),
                      (cp_compile.CPConfig(enable_dsa_cp=True, block_size=4), ["decode", "prefill", "verify"])):
        compiled = cp_compile.compile_model(Sparse(), config=cfg, lowering="eager", num_speculative_tokens=2)
        model = Sparse()
        steps = [m for batch in ("decode", "mixed") for m in two_step_metas(batch, dcp=1, block_size=4,
                                                                            num_blocks=32)] + verify_metas
        for i, meta in enumerate(steps + steps):
            if i == len(steps):  # varying acceptance: lengths differ, the graph does not
                torch.compiler.set_stance("fail_on_recompile")
            try:
                ids = torch.arange(meta.num_tokens)
                torch.testing.assert_close(compiled(ids, meta.positions, meta), model(ids, meta.positions, meta))
            finally:
                torch.compiler.set_stance("default")
        assert list(compiled.backends) == want
        assert [c.batch_kind for c in compiled.backends["verify"].contexts] == ["verify"]
    with pytest.raises(cp_compile.ConfigError, match="num_speculative_tokens"):
        cp_compile.compile_model(Sparse(), lowering="eager", num_speculative_tokens=-1)


def test_one_graph_when_kinds_do_not_differ():
    compiled = cp_compile.compile_model(Sparse(), config=cp_compile.CPConfig(block_size=4), lowering="eager")
    for batch in ("decode", "mixed"):
        meta = two_step_metas(batch, dcp=1, block_size=4, num_blocks=32)[1]
        compiled(torch.arange(meta.num_tokens), meta.positions, meta)
    assert list(compiled.backends) == [None] and [c.batch_kind for c in compiled.backend.contexts] == [None]
