"""Examples of cp-compile: example models, quick start and benchmarks (docs/architecture.md §9)."""
