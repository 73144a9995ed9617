"""The HCCL ops of a GE graph, executed over the gloo process groups of the same world.

The GE op names its communicator by torchair's group string; on gloo that is
`tag=<pg tag>;rank_list=<global ranks>` (torchair's hcom_utils). `Comm.group` finds
the live process group with exactly that rank list (and tag, when two groups share
the ranks), so a collective on the wrong group (wrong rank list, wrong size) runs on
a different set of ranks or is refused: the values show it.

Semantics (HCCL's, which torchair maps `_c10d_functional` to): AllGather and
ReduceScatter along dim 0 in rank order of the group, AllReduce elementwise,
AllToAllV over the flattened send buffer with per-rank element counts and
displacements.
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist

from tools.ge_eval.evaluator import Ctx, _ints, op

_REDUCE = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
           "prod": dist.ReduceOp.PRODUCT}


class Comm:
    """Resolves torchair group strings to the process groups of this rank's world."""

    def group(self, spec: str, ctx: Ctx):
        m = re.search(r"rank_list=([\d,]+)", spec)
        if not m:
            raise ctx.fail(f"group {spec!r} names no rank_list")
        ranks = [int(r) for r in m.group(1).split(",")]
        tag = re.search(r"tag=([^;]+)", spec)
        world = dist.distributed_c10d._world
        found = []
        for pg, mapping in world.pg_group_ranks.items():
            order = sorted(mapping, key=lambda g: mapping[g])  # global ranks by group rank
            if order == ranks:
                found.append(pg)
        if tag:
            tagged = [pg for pg in found if world.pg_to_tag.get(pg) == tag.group(1)]
            found = tagged or found
        if not found:
            raise ctx.fail(f"no process group with ranks {ranks} in this world")
        if dist.get_rank() not in ranks:
            raise ctx.fail(f"rank {dist.get_rank()} is not in group {ranks}")
        return found[0], len(ranks)


def _comm(ctx: Ctx) -> Comm:
    if ctx.comm is None:
        raise ctx.fail("an HCCL op in a graph evaluated without process groups")
    return ctx.comm


def _check_size(ctx, a, size):
    if "rank_size" in a and int(a["rank_size"]) != size:
        raise ctx.fail(f"rank_size {a['rank_size']} != size {size} of group {a['group']!r}")


@op("HcomAllGather")
def hcom_all_gather(ctx: Ctx, ins, a):
    pg, size = _comm(ctx).group(a["group"], ctx)
    _check_size(ctx, a, size)
    x = ins[0].contiguous()
    out = x.new_empty((size * x.shape[0], *x.shape[1:]))
    dist.all_gather_into_tensor(out, x, group=pg)
    return out


@op("HcomReduceScatter")
def hcom_reduce_scatter(ctx: Ctx, ins, a):
    pg, size = _comm(ctx).group(a["group"], ctx)
    _check_size(ctx, a, size)
    x = ins[0].contiguous()
    if x.shape[0] % size:
        raise ctx.fail(f"dim 0 of {tuple(x.shape)} does not split over {size} ranks")
    out = x.new_empty((x.shape[0] // size, *x.shape[1:]))
    dist.reduce_scatter_tensor(out, x, op=_REDUCE[a.get("reduction", "sum")], group=pg)
    return out


@op("HcomAllReduce")
def hcom_all_reduce(ctx: Ctx, ins, a):
    pg, _ = _comm(ctx).group(a["group"], ctx)
    out = ins[0].clone()
    dist.all_reduce(out, op=_REDUCE[a.get("reduction", "sum")], group=pg)
    return out


@op("HcomAllToAllV")
def hcom_all_to_all_v(ctx: Ctx, ins, a):
    n = ctx.named(ins)
    pg, size = _comm(ctx).group(a["group"], ctx)
    data = n["send_data"].contiguous().reshape(-1)
    sc, sd = _ints(n["send_counts"]), _ints(n["send_displacements"])
    rc, rd = _ints(n["recv_counts"]), _ints(n["recv_displacements"])
    if not (len(sc) == len(sd) == len(rc) == len(rd) == size):
        raise ctx.fail(f"counts / displacements of lengths {[len(sc), len(sd), len(rc), len(rd)]} for {size} ranks")
    send = torch.cat([data[d:d + c] for c, d in zip(sc, sd)])
    recv = data.new_empty(sum(rc))
    dist.all_to_all_single(recv, send, output_split_sizes=rc, input_split_sizes=sc, group=pg)
    out = data.new_empty(max((d + c for c, d in zip(rc, rd)), default=0))
    s = 0
    for c, d in zip(rc, rd):
        out[d:d + c] = recv[s:s + c]
        s += c
    # The received rows keep the send buffer's trailing dims (torchair's meta function for
    # its all-to-all decomposition; the GE graph adds no Reshape after the op).
    rows = n["send_data"].shape[1:]
    return out.reshape(-1, *rows) if n["send_data"].dim() > 1 else out
