"""Speculative decoding with a quantised KV cache (issue 39): greedy output with
speculation == greedy output without it, on the same quantised cache, token for token.

The harness is tests/spec_decode/test_spec_decode_model.py's (`case(...,
kv_cache_dtype=...)`): the target's and the proposer's caches are int8 / fp8 pages with
their fp32 scales; the oracle's drafts give rounds of 0, some and all k accepted; after
every verify step the test poisons every stale slot of the target's and the draft's
cache, codes (the largest code) and scales (NaN or 1e4) alike, so a rolled-back slot
whose code or scale were read before the next write overwrote them would change the
logits. Default: one device, uncompiled (a one-rank world: no dynamo trace). `slow`:
tp 2, dcp 2, eager, where each rolled-back slot's code and scale sit on its owner rank.
"""

from __future__ import annotations

import pytest

from tests.spec_decode.test_spec_decode_model import case, run_cases


def test_spec_decode_quantised_cache_greedy_equals_no_speculation():
    """GQA + draft model, int8, k 3, NaN poison; MLA + MTP, fp8, k 2, finite poison: tokens,
    acceptance and the proposer's logits equal the single-device runs on the same cache."""
    run_cases([case("qwen3", 1, 1, lowering=None, k=3, poison="nan", kv_cache_dtype="int8"),
               case("mla", 1, 1, lowering=None, k=2, kv_cache_dtype="fp8_e4m3")])


@pytest.mark.slow
def test_spec_decode_quantised_cache_dcp2():
    run_cases([case("qwen3", 2, 2, k=3, poison="nan", kv_cache_dtype="fp8_e4m3"),
               case("mla", 2, 2, k=2, interleave=2, kv_cache_dtype="int8")])

