"""Speculative decoding under DCP / PCP: proposers' draft loop, one verify step of
k + 1 tokens per request on the sharded cache, greedy acceptance or speculative
sampling, rollback of rejected tokens' KV blocks (docs/spec_decode.md)."""

from cp_compile.serving.spec_decode.acceptance import Accepted, greedy_accept, rejection_sample
from cp_compile.serving.spec_decode.proposer import DraftProposer
from cp_compile.serving.spec_decode.runner import Rollback, SpecDecoder, SpecResult, SpecStats
from cp_compile.base.sampling import Sampler, share  # the one sampler and token broadcast, re-exported

__all__ = ["Accepted", "DraftProposer", "Rollback", "Sampler", "SpecDecoder", "SpecResult", "SpecStats",
           "greedy_accept", "rejection_sample", "share"]
