"""Model shapes for the benchmark: the tiny CI model, and presets with real per-rank attention.

A preset reproduces what *one rank* of a real deployment attends with (query heads,
KV heads, head dims, hidden size), with few layers, at whatever `--tp` the
benchmark runs: the model is built with `per-rank heads x tp` query heads, so at
tp = 2 each rank holds exactly the per-rank attention of the deployment's tp = 8.
The MoE of the real models is replaced by a dense SwiGLU MLP as wide, per rank, as
the experts one token activates (TP-sharded): the bench measures attention and its
collectives, and keeps the per-step weight traffic of the rest in proportion.
Embeddings / lm_head use a small vocabulary (the real ones would only add a
constant per step). Weights are random (seeded), so no download is needed.

| preset | source | per rank at the deployment's tp |
|---|---|---|
| `tiny` | `examples/models/tiny.py` (CI) | 2 q heads (>= 4 total), 1 KV head, head_dim 16; MLA latent 32 + rope 8 |
| `qwen3-235b-a22b-tp8` | Qwen/Qwen3-235B-A22B `config.json`: hidden 4096, 64 q heads, 4 KV heads, head_dim 128, 94 layers, 8 of 128 experts x 1536 | tp 8: 8 q heads, 1 KV head (each KV head on 2 ranks), head_dim 128; MLP 8 x 1536 / 8 = 1536 |
| `deepseek-r1-tp8` | deepseek-ai/DeepSeek-R1 `config.json`: hidden 7168, 128 heads, q_lora 1536, kv_lora 512, rope 64, nope 128, v 128, 61 layers, 8 of 256 experts + 1 shared x 2048 | tp 8: 16 heads over the 512 + 64 latent; MLP 9 x 2048 / 8 = 2304 |
| `deepseek-v32-tp8` | deepseek-ai/DeepSeek-V3.2-Exp `config.json`: R1's attention and MLP, plus a lightning indexer per layer (64 heads x 128, top-2048) | as R1, with the indexer replicated on every rank (SFA DCP runs at dcp == tp) |

The SFA preset (`examples/models/deepseek_sfa.py`) takes `(latent, index_cache)` per layer
(`examples.serving.layer_caches`); GLM-5 has the same structure and is not a preset.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ShapePreset:
    name: str
    kind: str  # "qwen3" (GQA) | "mla" | "sfa" (MLA + lightning indexer)
    source: str  # where the numbers come from
    real_layers: int  # the deployment's layer count (KV budget maths)
    layers: int = 2  # layers the benchmark runs
    hidden: int = 0
    heads_per_rank: int = 0
    head_dim: int = 0  # GQA
    mlp_per_rank: int = 0
    # MLA
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # SFA: the indexer (replicated on every rank)
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    rope_theta: float = 10000.0
    vocab: int = 1024

    def model_config(self, tp: int) -> Any:
        """The example model's config with this preset's per-rank shapes at `tp` ranks."""
        if self.kind == "qwen3":
            from examples.models.qwen3 import Qwen3Config

            # One KV head, replicated on every rank: each rank holds one, as in the deployment.
            return Qwen3Config(vocab_size=self.vocab, hidden_size=self.hidden, num_layers=self.layers,
                               num_heads=self.heads_per_rank * tp, num_kv_heads=1, head_dim=self.head_dim,
                               intermediate_size=self.mlp_per_rank * tp, rope_theta=self.rope_theta)
        from examples.models.deepseek_mla import DeepseekMLAConfig
        from examples.models.deepseek_sfa import DeepseekSFAConfig

        mla = dict(vocab_size=self.vocab, hidden_size=self.hidden, num_layers=self.layers,
                   num_heads=self.heads_per_rank * tp, q_lora_rank=self.q_lora_rank,
                   kv_lora_rank=self.kv_lora_rank, qk_nope_head_dim=self.qk_nope_head_dim,
                   qk_rope_head_dim=self.qk_rope_head_dim, v_head_dim=self.v_head_dim,
                   intermediate_size=self.mlp_per_rank * tp, rope_theta=self.rope_theta)
        if self.kind == "sfa":
            return DeepseekSFAConfig(**mla, index_n_heads=self.index_n_heads, index_head_dim=self.index_head_dim,
                                     index_topk=self.index_topk)
        return DeepseekMLAConfig(**mla)


PRESETS = {
    p.name: p for p in (
        ShapePreset("qwen3-235b-a22b-tp8", "qwen3", "Qwen/Qwen3-235B-A22B config.json at tp 8", real_layers=94,
                    hidden=4096, heads_per_rank=8, head_dim=128, mlp_per_rank=1536, rope_theta=1_000_000.0),
        ShapePreset("deepseek-r1-tp8", "mla", "deepseek-ai/DeepSeek-R1 config.json at tp 8", real_layers=61,
                    hidden=7168, heads_per_rank=16, mlp_per_rank=2304, q_lora_rank=1536, kv_lora_rank=512,
                    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128),
        # DeepSeek-V3.2's MLA is R1's; each layer adds the lightning indexer (64 heads x 128, top-2048).
        ShapePreset("deepseek-v32-tp8", "sfa", "deepseek-ai/DeepSeek-V3.2-Exp config.json at tp 8", real_layers=61,
                    hidden=7168, heads_per_rank=16, mlp_per_rank=2304, q_lora_rank=1536, kv_lora_rank=512,
                    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, index_n_heads=64,
                    index_head_dim=128, index_topk=2048),
    )
}
SHAPES = ("tiny", *PRESETS)


@dataclass
class ModelSource:
    """What a rank builds its model from (picklable: shipped to spawned ranks).

    `tiny`: the tiny HF model's config and weights (identical on every rank);
    presets: the preset, built on each rank with seeded random weights.
    """

    shape: str
    kind: str
    real_layers: int
    hf_config: Any = None
    state_dict: dict[str, torch.Tensor] | None = None

    def build(self, tp: int, tp_rank: int, tp_group: dist.ProcessGroup | None) -> torch.nn.Module:
        if self.shape == "tiny":
            from examples.models.tiny import example_from_config

            return example_from_config(self.hf_config, self.state_dict, tp, tp_rank, tp_group)
        preset = PRESETS[self.shape]
        torch.manual_seed(1234 + tp_rank)
        cfg = preset.model_config(tp)
        if preset.kind == "qwen3":
            from examples.models.qwen3 import Qwen3Model

            return Qwen3Model(cfg, tp, tp_rank, tp_group).eval()
        from examples.models.deepseek_mla import DeepseekMLAModel
        from examples.models.deepseek_sfa import DeepseekSFAModel

        return (DeepseekSFAModel if preset.kind == "sfa" else DeepseekMLAModel)(cfg, tp, tp_rank, tp_group).eval()

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size if self.shape == "tiny" else PRESETS[self.shape].vocab


def model_source(shape: str, kind: str, tp: int) -> ModelSource:
    if shape == "tiny":
        from examples.bench.models import build_hf_model, hf_state_dict

        hf = build_hf_model(kind, tp)
        return ModelSource(shape, kind, hf.config.num_hidden_layers, hf.config, hf_state_dict(hf))
    preset = PRESETS[shape]
    return ModelSource(shape, preset.kind, preset.real_layers)
