"""Runs the enabled cp-compile passes in pipeline order and shows what they rewrote.

`PassManager.for_context(ctx)` keeps the passes of `passes/pipeline.py` that are
enabled for the compile context, in registry order. After every pass the nodes it
created get fake values (`fx_utils.propagate_fake_values`), so the next pass can
read their shapes.

Graph dumps: set `CP_COMPILE_DUMP_GRAPHS=<dir>` to write each graph before and
after every pass (`<dir>/<graph>-<nn>-<pass>-{before,after}.txt`, with op counts),
or enable the `cp_compile.passes` logger at DEBUG (`CP_COMPILE_LOG=debug`) to log them.
"""

from __future__ import annotations

import itertools
import logging
import os
from dataclasses import dataclass, field

import torch.fx as fx

from cp_compile.passes.context import CompileContext
from cp_compile.passes.base import CPPass
from cp_compile.passes.fx_utils import count_ops, propagate_fake_values
from cp_compile.passes.pipeline import PIPELINE

log = logging.getLogger("cp_compile.passes")
if os.environ.get("CP_COMPILE_LOG", "").lower() == "debug":
    logging.basicConfig()
    log.setLevel(logging.DEBUG)

_graph_ids = itertools.count()


@dataclass
class PassRecord:
    name: str
    rewrites: int
    before: dict[str, int]
    after: dict[str, int]
    # What the pass decided beyond its rewrites (dcp_attention / pcp_attention: the
    # merge, why, and the predicted cost of each; passes/merge_choice.py).
    decision: dict | None = None


@dataclass
class PassManager:
    passes: list[CPPass]
    history: list[PassRecord] = field(default_factory=list)

    @classmethod
    def for_context(cls, ctx: CompileContext) -> "PassManager":
        """The pipeline's passes that are enabled for `ctx`, in registry order."""
        return cls([p(ctx) for p in PIPELINE if p.is_enabled(ctx)])

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.passes]

    def __call__(self, gm: fx.GraphModule) -> fx.GraphModule:
        dump_dir = os.environ.get("CP_COMPILE_DUMP_GRAPHS")
        gid = next(_graph_ids)
        for i, p in enumerate(self.passes):
            before = count_ops(gm)
            self._dump(dump_dir, gid, i, p.name, "before", gm)
            n = p(gm)
            propagate_fake_values(gm)
            after = count_ops(gm)
            self._dump(dump_dir, gid, i, p.name, "after", gm)
            self.history.append(PassRecord(p.name, n, before, after, getattr(p, "decision", None)))
            log.info("pass %s: %d rewrites", p.name, n)
        return gm

    @staticmethod
    def _dump(dump_dir: str | None, gid: int, i: int, name: str, when: str, gm: fx.GraphModule) -> None:
        if dump_dir is None and not log.isEnabledFor(logging.DEBUG):
            return
        ops = "\n".join(f"  {v:4d}  {k}" for k, v in sorted(count_ops(gm).items()))
        text = f"# graph {gid}, pass {name}, {when}\n# op counts:\n{ops}\n\n{gm.graph}"
        log.debug("%s", text)
        if dump_dir:
            os.makedirs(dump_dir, exist_ok=True)
            with open(os.path.join(dump_dir, f"graph{gid:03d}-{i:02d}-{name}-{when}.txt"), "w") as f:
                f.write(text)
