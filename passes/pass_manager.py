"""Runs the cp-compile passes in a fixed order and shows what they rewrote.

Order (each pass sees the output of the previous one):
  1. dcp_attention — single-device attention nodes -> DCP building blocks.

Graph dumps: set `CP_COMPILE_DUMP_GRAPHS=<dir>` to write each graph before and
after every pass (`<dir>/<graph>-<nn>-<pass>-{before,after}.txt`, with op counts),
or enable the `cp_compile.passes` logger at DEBUG (`CP_COMPILE_LOG=debug`) to log them.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
from dataclasses import dataclass, field

import torch.fx as fx

from cp_compile.passes.base import CPPass
from cp_compile.passes.dcp_attention import count_ops

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


@dataclass
class PassManager:
    passes: list[CPPass]
    history: list[PassRecord] = field(default_factory=list)

    def uuid(self) -> str:
        return hashlib.sha256("".join(p.uuid() for p in self.passes).encode()).hexdigest()

    def __call__(self, gm: fx.GraphModule) -> fx.GraphModule:
        dump_dir = os.environ.get("CP_COMPILE_DUMP_GRAPHS")
        gid = next(_graph_ids)
        for i, p in enumerate(self.passes):
            before = count_ops(gm)
            self._dump(dump_dir, gid, i, p.name, "before", gm)
            n = p(gm)
            after = count_ops(gm)
            self._dump(dump_dir, gid, i, p.name, "after", gm)
            self.history.append(PassRecord(p.name, n, before, after))
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
