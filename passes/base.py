"""Base class of cp-compile FX passes."""

from __future__ import annotations

import abc
import hashlib
import inspect
import sys
from typing import Any

import torch.fx as fx


class CPPass(abc.ABC):
    """A graph-to-graph rewrite on the Dynamo FX graph (before AOTAutograd).

    Subclasses list in `config_fields` every setting they read, so that `uuid()` —
    a hash of the pass's source file and those values — changes whenever the pass
    could produce a different graph, and compile caches never serve a stale one.
    """

    name: str = "cp_pass"
    config_fields: tuple[str, ...] = ()

    @abc.abstractmethod
    def __call__(self, gm: fx.GraphModule) -> int:
        """Rewrite `gm` in place; return the number of rewrites made."""

    def config_values(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in self.config_fields}

    def uuid(self) -> str:
        h = hashlib.sha256()
        h.update(inspect.getsource(sys.modules[type(self).__module__]).encode())
        h.update(repr(sorted(self.config_values().items())).encode())
        return h.hexdigest()
