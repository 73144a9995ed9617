"""The errors every layer may raise (the bottom layer, with `config`: imports nothing of the project).

`ConfigError`: a configuration breaks a rule of docs/architecture.md §7.
`MetadataError`: attention metadata that would write or read the wrong cache entries.
`CapacityError`: the KV cache has no free block for a request.
They live here, below the ops, because the op references refuse bad metadata
(`MetadataError`) and the passes refuse configs (`ConfigError`); the front door
re-exports them (`cp_compile.ConfigError`, `cp_compile.MetadataError`, ...).
"""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A configuration breaks one of the rules of docs/architecture.md §7."""

    def __init__(self, rule: str, values: str, fix: str) -> None:
        self.rule = rule
        super().__init__(f"rule `{rule}` violated: {values}. Fix: {fix}")


class MetadataError(ValueError):
    """Attention metadata that would write or read the wrong cache entries.

    Raised before any cache write. `field`, `request` (request index, or None) and
    `value` locate the problem; the message ends with the fix.
    """

    def __init__(self, field: str, problem: str, fix: str, *, request: int | None = None,
                 value: Any = None) -> None:
        self.field = field
        self.request = request
        self.value = value
        where = f" (request {request})" if request is not None else ""
        super().__init__(f"{field}{where}: {problem}. Fix: {fix}")


class CapacityError(RuntimeError):
    """The KV cache has no free block for a request."""
