"""Model-config fields the ops depend on are validated, naming the field (issue 19).

Before: `index_topk=0` ran with zero attention output in every layer (3.51 off HF),
`index_topk=-4` failed as `negative dimension -4`; a GLM-5 / V3.2 config whose
`mlp_layer_types` marks MoE layers (transformers 5.x decides MoE from it) failed as
`KeyError: checkpoint has no tensor ...mlp.gate_proj.weight`.
"""

from __future__ import annotations

import dataclasses

import pytest

from cp_compile.base.config import ConfigError
from examples.models.deepseek_mla import DeepseekMLAConfig
from examples.models.deepseek_sfa import DeepseekSFAConfig
from examples.models.qwen3 import Qwen3Config
from examples.models.tiny import example_from_hf, hf_deepseek_sfa, hf_qwen3


@pytest.mark.parametrize("topk", [0, -4])
def test_index_topk_below_one_refused_naming_it(topk):
    hf = hf_deepseek_sfa("glm_moe_dsa")
    hf.config.index_topk = topk
    with pytest.raises(ConfigError, match=rf"DeepseekSFAConfig.index_topk >= 1.*index_topk={topk}"):
        example_from_hf(hf)


@pytest.mark.parametrize("cls, field, value, rule", [
    (Qwen3Config, "num_heads", 0, "num_heads >= 1"),
    (Qwen3Config, "num_kv_heads", -1, "num_kv_heads >= 1"),
    (Qwen3Config, "num_kv_heads", 3, "num_heads % Qwen3Config.num_kv_heads"),
    (Qwen3Config, "head_dim", 15, "head_dim is even"),
    (DeepseekMLAConfig, "kv_lora_rank", 0, "kv_lora_rank >= 1"),
    (DeepseekMLAConfig, "qk_rope_head_dim", 7, "qk_rope_head_dim is even"),
    (DeepseekMLAConfig, "q_lora_rank", 0, "q_lora_rank >= 1"),
    (DeepseekSFAConfig, "index_n_heads", 0, "index_n_heads >= 1"),
    (DeepseekSFAConfig, "index_head_dim", -2, "index_head_dim >= 1"),
])
def test_head_counts_and_dims_refused_naming_the_field(cls, field, value, rule):
    with pytest.raises(ConfigError, match=rule):
        dataclasses.replace(cls(), **{field: value})
    cls()  # the defaults are valid


def test_qwen3_hf_head_count_refused():
    hf = hf_qwen3()
    hf.config.num_key_value_heads = 3
    with pytest.raises(ConfigError, match="num_kv_heads=3"):
        example_from_hf(hf)


@pytest.mark.parametrize("model_type", ["deepseek_v32", "glm_moe_dsa"])
def test_mlp_layer_types_moe_refused_naming_moe(model_type):
    hf = hf_deepseek_sfa(model_type)
    hf.config.mlp_layer_types = ["dense", "sparse"]  # what transformers 5.x builds a MoE layer from
    with pytest.raises(NotImplementedError, match=r"mlp_layer_types marks layers \[1\] as MoE"):
        example_from_hf(hf)
