"""The runtime layer (above ops and passes): `metadata` (AttentionMetadata, BlockAllocator,
build_attention_metadata) with its per-step checks (`metadata_checks`), `kv_cache`
(allocate_kv_cache), `parallel_state` (init_parallel: the live groups) and
`o_proj_full_weight` (DSA-CP's o_proj for eager models)."""
