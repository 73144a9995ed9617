"""Tiny random checkpoints of the seeds' models (what their users serve), offline.

    model = tiny_seed_model("deepseek_v2_lite")        # MLA + MoE (routed + shared experts)
    save_checkpoint(model, "/tmp/ds")                   # safetensors + config + a tiny tokenizer

Kinds: `deepseek_v2_lite` (DeepSeek-V2-Lite shape: MLA without q_lora, softmax greedy
routing, 2 shared experts), `deepseek_v3` (R1 shape: q_lora, sigmoid group-limited
routing with the correction bias), `qwen3_moe` (Qwen3-235B shape: GQA, softmax
top-k with normalised weights, no shared expert), `deepseek_v32` / `glm5` (V3's MoE
plus DeepSeek Sparse Attention: a lightning indexer picks 5 keys per query, fewer
than the test prompts hold, so the attention is really sparse). Layer 0 is dense, layer 1 MoE, so
both MLP paths are served. `_randomize` gives O(1) activations; the router bias is
randomised too so the bias path changes the routing.

The tokenizer is a word-level, lower-casing `tokenizers` model over a fixed word list
(built here, no download), with `<s>` / `</s>` / `<unk>`; its vocab is the model's
(VOCAB). Its EOS `</s>` (id 2) is the checkpoint's `eos_token_id`.
"""

from __future__ import annotations

import json
import os

import torch
import transformers

from examples.models.tiny import VOCAB, _randomize

KINDS = ("deepseek_v2_lite", "deepseek_v3", "qwen3_moe", "deepseek_v32", "glm5")
ROPE = {"rope_type": "default", "rope_theta": 10000.0}
EOS_ID = 2


def _config(kind: str) -> transformers.PretrainedConfig:
    mla = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
               num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
               kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, rms_norm_eps=1e-2, rope_parameters=ROPE,
               tie_word_embeddings=False, attn_implementation="eager", bos_token_id=1, eos_token_id=EOS_ID)
    if kind == "deepseek_v2_lite":
        return transformers.DeepseekV2Config(q_lora_rank=None, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
                                             n_shared_experts=2, topk_method="greedy", routed_scaling_factor=1.0,
                                             **mla)
    if kind == "deepseek_v3":
        return transformers.DeepseekV3Config(q_lora_rank=24, v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2,
                                             n_shared_experts=1, n_group=4, topk_group=2, norm_topk_prob=True,
                                             routed_scaling_factor=2.5, **mla)
    if kind in ("deepseek_v32", "glm5"):
        # 16 indexer heads: with few, keys whose q . k < 0 on every head tie at score 0 and
        # HF's topk breaks those ties arbitrarily (examples/models/tiny.py hf_deepseek_sfa).
        cls = transformers.DeepseekV32Config if kind == "deepseek_v32" else transformers.GlmMoeDsaConfig
        extra = {"indexer_types": ["full"] * mla["num_hidden_layers"]} if kind == "glm5" else {}
        return cls(q_lora_rank=24, v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                   n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5, index_n_heads=16,
                   index_head_dim=16, index_topk=5, **extra, **mla)
    if kind == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=1, head_dim=16, num_experts=8, num_experts_per_tok=2,
            norm_topk_prob=True, mlp_only_layers=[0], decoder_sparse_step=1, rms_norm_eps=1e-6,
            rope_parameters=ROPE, tie_word_embeddings=False, attn_implementation="eager", bos_token_id=1,
            eos_token_id=EOS_ID)
    raise ValueError(f"tiny seed model {kind!r}: choose one of {KINDS}")


def tiny_seed_model(kind: str, seed: int = 7) -> transformers.PreTrainedModel:
    cfg = _config(kind)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    _randomize(model, seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.3 * torch.randn(buf.shape, generator=g))
    return model


WORDS = ("future ai hello name capital france the a of to and in is it that was for on are with as his they be at one have this from or had by "
         "word but what some we can out other were all there when up use your how said an each she which do "
         "their time if will way about many then them write would like so these her long make thing see him "
         "two has look more day could go come did number sound no most people my over know water than call "
         "first who may down side been now find any new work part take get place made live where after back "
         "little only round man year came show every good me give our under name very through just form").split()


def build_tokenizer(vocab_size: int = VOCAB) -> "transformers.PreTrainedTokenizerFast":
    """A word-level tokenizer with `vocab_size` ids: 0 <unk>, 1 <s>, 2 </s>, then words."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

    words = [w for w in dict.fromkeys(WORDS)][:vocab_size - 3]
    words += [f"w{i}" for i in range(vocab_size - 3 - len(words))]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                                eos_token="</s>", pad_token="<unk>")


def save_checkpoint(model: transformers.PreTrainedModel, path: str, tokenizer: bool = True) -> str:
    """`save_pretrained` (safetensors + config.json + generation_config.json), plus the
    tiny tokenizer; returns `path`."""
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    if tokenizer:
        build_tokenizer(model.config.vocab_size).save_pretrained(path)
    with open(os.path.join(path, "cp_compile_tiny.json"), "w") as f:
        json.dump({"what": "tiny random checkpoint written by examples.models.tiny_seed"}, f)
    return path
