"""Process groups for TP, DCP (inside TP) and PCP (docs/architecture.md §1, §7).

Ranks are laid out as world = pcp x tp: TP group g is ranks [g*tp, (g+1)*tp); DCP
groups are consecutive runs of `dcp` ranks inside each TP group (so GQA DCP ranks
share KV heads); PCP groups join the ranks with the same TP rank across TP groups.
The context-parallel (CP) group joins the pcp * dcp ranks that share this rank's KV
heads, ascending, so its group rank is the cp rank `pcp_rank * dcp + dcp_rank`
(docs/pcp.md §2): the KV cache is sharded over it, and decode graphs at pcp > 1 run
the DCP attention over it (N = pcp * dcp). At pcp = 1 it is the DCP group, at
dcp = 1 the PCP group (no extra group is created for those).
The groups come from one `torch.distributed.device_mesh.DeviceMesh` of shape
(pcp, tp // dcp, dcp) (`build_mesh`; TP and CP are its flattened sub-meshes), as
torchtitan's ParallelDims builds its groups; what compiles read of them is the
`Layout` (`cp_compile/base/parallel_layout.py`).
Works on a world set up by `torchrun` (env://) or by the test harness.

Every group gets a bounded timeout (`init_parallel(timeout=...)`, else the
`CP_COMPILE_PG_TIMEOUT_S` environment variable, else `DEFAULT_PG_TIMEOUT_S` = 600 s,
NCCL's own default): a rank whose peer stopped taking part in a collective (it
raised and went on, or hangs) raises after that long instead of waiting forever.
A peer whose process died fails the collective at once on gloo (connection closed).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from cp_compile.base.config import ConfigError, CPConfig
from cp_compile.base.merge_cost import CollectiveCosts, calibrate
from cp_compile.base.parallel_layout import Group, Layout


@dataclass
class ParallelState:
    """The live side of the layout: the process groups `init_parallel` created for
    this rank (and the mesh they come from), its device, backend, collective timeout
    and measured collective costs. What a compile is specialised on is `layout`
    (`cp_compile.base.parallel_layout.Layout`: each group's size, this rank's place in it
    and its name), the one place those facts live: `state.layout.tp.rank`, no copy
    here (decision 40)."""

    cfg: CPConfig
    rank: int
    world_size: int
    device: torch.device
    backend: str
    layout: Layout
    # The device mesh the groups come from (`build_mesh`): dims "pcp", "tp_outer", "dcp".
    mesh: DeviceMesh
    tp_group: dist.ProcessGroup
    dcp_group: dist.ProcessGroup
    pcp_group: dist.ProcessGroup
    # The pcp * dcp ranks sharing this rank's KV heads (the KV cache is sharded over
    # them); group rank == cp_rank = pcp_rank * dcp + dcp_rank. The DCP group at pcp = 1.
    cp_group: dist.ProcessGroup
    timeout_s: float = 0.0  # collective timeout of the TP / DCP / PCP groups
    # dcp_merge="auto": the CP group's measured collective costs (merge_cost.calibrate).
    collective_costs: CollectiveCosts | None = None


_STATE: ParallelState | None = None


def default_device() -> torch.device:
    """NPU when torch_npu is importable and has devices, else CUDA, else CPU."""
    try:
        import torch_npu  # noqa: F401  (optional; registers torch.npu)

        if torch.npu.is_available():  # type: ignore[attr-defined]
            return torch.device("npu", int(os.environ.get("LOCAL_RANK", 0)))
    except ImportError:
        pass
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def bind_device(device: torch.device) -> torch.device:
    """Make `device` this process's current CUDA / NPU device; returns it with its index.

    A device without an index gets the local rank ($LOCAL_RANK, torchrun's), so
    every rank of a node drives its own accelerator: NCCL / HCCL collectives (the
    layout check's all_gather_object included) and tensors made with a bare
    device="cuda" then land on that device, not all on device 0. CPU is returned as is.
    """
    if device.type not in ("cuda", "npu"):
        return device
    index = device.index if device.index is not None else int(os.environ.get("LOCAL_RANK", 0))
    module = torch.cuda if device.type == "cuda" else getattr(torch, "npu")  # torch.npu: torch_npu imported
    module.set_device(index)
    return torch.device(device.type, index)


def backend_for(device: torch.device) -> str:
    return {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}[device.type]


DEFAULT_PG_TIMEOUT_S = 600.0
PG_TIMEOUT_ENV = "CP_COMPILE_PG_TIMEOUT_S"


def resolve_timeout(timeout: float | timedelta | None) -> float:
    """Seconds: the argument, else $CP_COMPILE_PG_TIMEOUT_S, else DEFAULT_PG_TIMEOUT_S."""
    if timeout is None:
        raw = os.environ.get(PG_TIMEOUT_ENV)
        if raw is None:
            return DEFAULT_PG_TIMEOUT_S
        try:
            timeout = float(raw)
        except ValueError:
            raise ConfigError("process-group timeout is a number of seconds", f"{PG_TIMEOUT_ENV}={raw!r}",
                              f"set {PG_TIMEOUT_ENV} to a positive number, e.g. 600") from None
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
        raise ConfigError("process-group timeout > 0", f"timeout={timeout!r}",
                          "pass a positive number of seconds (or a timedelta) as init_parallel(timeout=...)")
    return float(seconds)


def _hccl_options() -> Any:
    """torch_npu's HCCL process-group options class, or None without torch_npu."""
    try:
        import torch_npu  # noqa: F401  (optional: the NPU backend)
    except ImportError:
        return None
    return torch_npu._C._distributed_c10d.ProcessGroupHCCL.Options


def _options(backend: str, timeout: timedelta) -> tuple[str, Any]:
    """A process group's backend with this timeout (DeviceMesh creates groups from it):
    the backend's options object with `_timeout` set (gloo, NCCL; HCCL through
    torch_npu's `ProcessGroupHCCL.Options`, as torch_npu's own group factory sets it;
    not run here: no torch_npu / NPU on this machine), else no options (the default
    group's timeout)."""
    nccl = getattr(dist, "ProcessGroupNCCL", None)
    opts = {"gloo": dist.ProcessGroupGloo._Options, "nccl": nccl.Options if nccl is not None else None,
            "hccl": _hccl_options() if backend == "hccl" else None}.get(backend)
    if opts is None:
        return (backend, None)
    o = opts()
    o._timeout = timeout
    return (backend, o)


def build_mesh(device: torch.device, backend: str, *, pcp: int, tp: int, dcp: int,
               timeout: timedelta) -> tuple[DeviceMesh, dict[str, DeviceMesh]]:
    """The world as a device mesh `(pcp, tp // dcp, dcp)` ("pcp", "tp_outer", "dcp"),
    row-major over the world ranks (world = pcp x tp, DCP ranks consecutive inside a TP
    group), and this rank's 1-D meshes by group: "pcp", "dcp", "tp" = ("tp_outer",
    "dcp") flattened, "cp" = ("pcp", "dcp") flattened (pcp-major, so its local rank is
    the cp rank `pcp_rank * dcp + dcp_rank`). A flattened dim of which one part has
    size 1 is that other part (flattening would create a second group of the same
    ranks). Collective over the world: every rank calls it alike."""
    override = _options(backend, timeout)
    names = ("pcp", "tp_outer", "dcp")
    mesh = init_device_mesh(device.type, (pcp, tp // dcp, dcp), mesh_dim_names=names,
                            backend_override={n: override for n in names})

    def joined(outer: str, inner: str, name: str) -> DeviceMesh:
        if mesh[outer].size() == 1:
            return mesh[inner]
        if mesh[inner].size() == 1:
            return mesh[outer]
        return mesh[outer, inner]._flatten(name, backend_override=override)

    return mesh, {"pcp": mesh["pcp"], "dcp": mesh["dcp"], "tp": joined("tp_outer", "dcp", "tp"),
                  "cp": joined("pcp", "dcp", "cp")}


def init_parallel(cfg: CPConfig, device: torch.device | str | None = None,
                  timeout: float | timedelta | None = None) -> ParallelState:
    """Create the TP / DCP / PCP groups for `cfg` and make them current.

    Initialises torch.distributed from the environment (torchrun) when it is not
    initialised yet. Every rank must call this with the same config.
    `timeout` (seconds or timedelta) bounds every collective of the groups created
    here (and of the default group when this call creates it): a rank whose peer
    stopped taking part raises after that long. Default: $CP_COMPILE_PG_TIMEOUT_S,
    else 600 s. Leave room for the slowest rank's first-step compile, which peers
    wait out inside their first collective.
    """
    global _STATE
    if _STATE is not None:
        raise RuntimeError("parallel state already initialised; call cp_compile.destroy_parallel() first")
    timeout_s = resolve_timeout(timeout)
    pg_timeout = timedelta(seconds=timeout_s)
    # Bound before the process group exists: NCCL / HCCL pick the current device.
    device = bind_device(torch.device(device) if device is not None else default_device())
    backend = backend_for(device)
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            raise RuntimeError("torch.distributed is not initialised and RANK is not set. Fix: launch with "
                               "`torchrun --nproc-per-node=N ...` or call dist.init_process_group first")
        dist.init_process_group(backend=backend, timeout=pg_timeout)
    world, rank = dist.get_world_size(), dist.get_rank()
    cfg.validate_world_size(world)  # raises ConfigError; before any group is created
    tp, dcp, pcp = cfg.tensor_parallel_size, cfg.decode_context_parallel_size, cfg.prefill_context_parallel_size
    if tp % dcp != 0:
        raise ConfigError("tp % dcp == 0", f"tensor_parallel_size={tp}, decode_context_parallel_size={dcp}",
                          "choose a decode_context_parallel_size that divides tensor_parallel_size")
    # The groups come from a DeviceMesh (decision 40): every rank creates every group, in order.
    mesh, dims = build_mesh(device, backend, pcp=pcp, tp=tp, dcp=dcp, timeout=pg_timeout)
    tp_group, dcp_group, pcp_group, cp_group = (dims[n].get_group() for n in ("tp", "dcp", "pcp", "cp"))
    tp_rank, dcp_rank, pcp_rank = (dims[n].get_local_rank() for n in ("tp", "dcp", "pcp"))
    layout = Layout(tp=Group(tp, tp_rank, tp_group.group_name), dcp=Group(dcp, dcp_rank, dcp_group.group_name),
                    pcp=Group(pcp, pcp_rank, pcp_group.group_name),
                    cp=Group(pcp * dcp, dims["cp"].get_local_rank(), cp_group.group_name))
    layout.check(cfg)
    assert layout.cp.rank == pcp_rank * dcp + dcp_rank, "the cp mesh dim is pcp-major (docs/pcp.md §2)"
    # The merge's cost model needs the collectives' costs on the group decode merges over.
    costs = calibrate(cp_group, device) if cfg.dcp_merge == "auto" and cfg.context_parallel_size > 1 else None
    _STATE = ParallelState(cfg=cfg, rank=rank, world_size=world, device=device, backend=backend, layout=layout,
                           mesh=mesh, tp_group=tp_group, dcp_group=dcp_group, pcp_group=pcp_group, cp_group=cp_group,
                           timeout_s=timeout_s, collective_costs=costs)
    return _STATE


def get_parallel_state() -> ParallelState:
    if _STATE is None:
        raise RuntimeError("parallel state not initialised. Fix: call cp_compile.init_parallel(cfg) on every rank")
    return _STATE


def parallel_state_or_none() -> ParallelState | None:
    return _STATE


def destroy_parallel(destroy_process_group: bool = False) -> None:
    """Forget the current groups (and optionally tear down torch.distributed)."""
    global _STATE
    if _STATE is not None:
        for grp in {_STATE.tp_group, _STATE.dcp_group, _STATE.pcp_group, _STATE.cp_group}:
            dist.destroy_process_group(grp)
    _STATE = None
    if destroy_process_group and dist.is_initialized():
        dist.destroy_process_group()
