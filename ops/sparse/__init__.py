"""The sparse (DSA) family: `cp::lightning_indexer`, `cp::sparse_mla_attention`,
`cp::dcp_sparse_indices`, `cp::sparse_mla_partial_attention` (`ops.py`) and the
DSA-CP token-shard ops `cp::lightning_indexer_topk_rows`, `cp::sparse_mla_rows_attention`
(`dsa_cp.py`).

`reference.py` (torch oracle), `triton_indexer.py` / `triton_sparse_mla.py` (Triton),
`launch.py` (the ops' device kernels), `ge.py` / `ge_dsa_cp.py` (GE converters).
"""
