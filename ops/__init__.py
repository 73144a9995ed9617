"""Custom ops of cp-compile (installed as `cp_compile.ops`).

Importing this package registers every `cp::*` op with torch.library.
"""

from cp_compile.ops import layout, reference  # noqa: F401
