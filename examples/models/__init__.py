"""Example models: plain single-device PyTorch (TP written out plainly) calling the
`torch.ops.cp.*` attention ops. The DCP passes rewrite those ops; the models never
mention DCP.

- `examples.models.qwen3`: Qwen3-style GQA (`Qwen3Model`).
- `examples.models.deepseek_mla`: DeepSeek-V2/V3-style absorbed MLA, dense MLP
  (`DeepseekMLAModel`).
- `examples.models.deepseek_sfa`: DeepSeek-V3.2 / GLM-5-style MLA with a lightning
  indexer (sparse top-k attention), dense MLP (`DeepseekSFAModel`).
"""
