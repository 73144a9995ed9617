"""FX passes of cp-compile (installed as `cp_compile.passes`).

Imported as anything but `cp_compile.passes` (`import passes` from the repository
root) it refuses to load, rather than be a second copy of every pass.
"""

if __name__ != "cp_compile.passes":  # e.g. `import passes` with the repository root on sys.path
    raise ImportError(
        f"{__name__!r}: the passes/ folder is the package `cp_compile.passes`; imported under another name it "
        f"would be a second copy of every pass and of its compile context. Fix: `import cp_compile.passes` "
        f"(`from cp_compile.passes import ...`)")
