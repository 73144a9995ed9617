"""Parallel state on real gloo worlds, and the multi-rank harness itself."""

import time

import pytest
import torch
import torch.distributed as dist

import cp_compile
from cp_compile.passes.context import CompileContext
from cp_compile.testing.multirank import RankFailed, run_on_ranks


def _groups(rank: int, world: int, cfgs: list[cp_compile.CPConfig]) -> list[dict]:
    out = []
    for cfg in cfgs:
        st = cp_compile.init_parallel(cfg, device="cpu")
        # A real collective on each group proves the groups are usable.
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=st.dcp_group)
        out.append(dict(tp=dist.get_process_group_ranks(st.tp_group),
                        dcp=dist.get_process_group_ranks(st.dcp_group),
                        pcp=dist.get_process_group_ranks(st.pcp_group),
                        cp=dist.get_process_group_ranks(st.cp_group), cp_rank=st.layout.cp.rank,
                        cp_group_rank=dist.get_rank(st.cp_group),
                        ctx_cp=CompileContext.from_state(st).cp,
                        tp_rank=st.layout.tp.rank, dcp_rank=st.layout.dcp.rank, pcp_rank=st.layout.pcp.rank,
                        dcp_sum=t.item(), backend=st.backend))
        cp_compile.destroy_parallel()
    return out


def _bad_world(rank: int, world: int) -> None:
    cp_compile.init_parallel(cp_compile.CPConfig(tensor_parallel_size=4), device="cpu")


def _raise_on_rank_one(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError("boom from rank one")
    return rank


def _hang(rank: int, world: int) -> None:
    if rank == 0:
        dist.barrier()  # rank 1 never joins
    else:
        time.sleep(3600)


def test_groups_on_four_ranks():
    cfgs = [cp_compile.CPConfig(tensor_parallel_size=4, decode_context_parallel_size=2),
            cp_compile.CPConfig(tensor_parallel_size=4, decode_context_parallel_size=4),
            cp_compile.CPConfig(tensor_parallel_size=2, prefill_context_parallel_size=2),
            cp_compile.CPConfig(tensor_parallel_size=2, decode_context_parallel_size=2,
                                prefill_context_parallel_size=2)]
    res = run_on_ranks(_groups, 4, cfgs)
    for rank, per_cfg in enumerate(res):
        a, b, c, d = per_cfg
        assert a["tp"] == [0, 1, 2, 3] and a["dcp"] == ([0, 1] if rank < 2 else [2, 3])
        assert a["dcp_rank"] == rank % 2 and a["dcp_sum"] == sum(a["dcp"]) and a["backend"] == "gloo"
        assert b["dcp"] == [0, 1, 2, 3] and b["dcp_rank"] == rank
        assert c["tp"] == ([0, 1] if rank < 2 else [2, 3]) and c["pcp"] == [rank % 2, rank % 2 + 2]
        assert c["tp_rank"] == rank % 2 and c["pcp_rank"] == rank // 2 and c["dcp"] == [rank]
        # The context-parallel group: the pcp * dcp ranks sharing this rank's KV heads, group rank ==
        # cp rank == pcp_rank * dcp + dcp_rank (docs/pcp.md §2); the DCP group at pcp = 1.
        assert a["cp"] == a["dcp"] and a["cp_rank"] == a["dcp_rank"] == a["cp_group_rank"]
        assert c["cp"] == c["pcp"] and c["cp_rank"] == c["pcp_rank"] == c["cp_group_rank"]
        assert d["cp"] == [0, 1, 2, 3] and d["cp_rank"] == d["cp_group_rank"] == rank
        assert d["cp_rank"] == d["pcp_rank"] * 2 + d["dcp_rank"]
        assert (d["ctx_cp"].size, d["ctx_cp"].rank) == (4, rank) and d["ctx_cp"].name


def test_world_size_mismatch_is_config_error():
    with pytest.raises(RankFailed, match="world size == tp \\* pcp"):
        run_on_ranks(_bad_world, 2)


def test_rank_exception_carries_traceback():
    with pytest.raises(RankFailed, match="rank 1 of 2 failed:(.|\n)*boom from rank one"):
        run_on_ranks(_raise_on_rank_one, 2)


def test_hang_is_killed():
    with pytest.raises(TimeoutError, match="did not finish"):
        run_on_ranks(_hang, 2, timeout=8)


def test_group_options_carry_the_timeout(monkeypatch):
    """Every backend's groups get the configured timeout as options (DeviceMesh's
    backend_override). HCCL through torch_npu's ProcessGroupHCCL.Options: torch_npu
    cannot be installed here, so a module of that shape stands in for it (what the
    real class accepts is unverified without an NPU)."""
    import sys
    from datetime import timedelta
    from types import ModuleType, SimpleNamespace

    from cp_compile.runtime.parallel_state import _options

    t = timedelta(seconds=7)
    for backend in ("gloo", "nccl"):
        name, opts = _options(backend, t)
        if backend == "nccl" and not dist.is_nccl_available():  # a CPU-only torch build (CI)
            assert opts is None
            continue
        assert name == backend and opts._timeout == t
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # not importable: no options, the default timeout
    assert _options("hccl", t) == ("hccl", None)
    npu = ModuleType("torch_npu")
    npu._C = SimpleNamespace(_distributed_c10d=SimpleNamespace(ProcessGroupHCCL=SimpleNamespace(
        Options=type("Options", (), {}))))
    monkeypatch.setitem(sys.modules, "torch_npu", npu)
    name, opts = _options("hccl", t)
    assert name == "hccl" and type(opts).__name__ == "Options" and opts._timeout == t
