"""FX passes of cp-compile (installed as `cp_compile.passes`)."""
