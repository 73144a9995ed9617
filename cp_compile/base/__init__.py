"""The base layer: what every other layer may read or raise (torch only).

`config` (CPConfig, AttentionSpec, BatchKind: every rule of docs/architecture.md §7),
`errors`, `parallel_layout` (this rank's TP / DCP / PCP groups as numbers), `sampling`
(SamplingParams and the one Sampler), and the collective cost models `comm_stats` and
`merge_cost` (which may import the rest of base).
"""
