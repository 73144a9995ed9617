"""Examples of cp-compile: example models, quick start and benchmarks (DESIGN.md §9)."""
