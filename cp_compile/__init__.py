"""cp-compile: decode context parallel (DCP) as a torch.compile backend.

Public API: `CPConfig`, `ConfigError`, `AttentionSpec`, `init_parallel`,
`destroy_parallel`, `get_parallel_state`, `allocate_kv_cache`,
`build_attention_metadata`, `BlockAllocator`; the offline front end `LLM`, `SamplingParams`
(cp_compile/entrypoints/, docs/hf.md); `cp-compile serve` (cp_compile/entrypoints/server.py). Custom ops live in `cp_compile.ops`.
"""

from cp_compile.config import AttentionSpec, ConfigError, CPConfig
from cp_compile.kv_cache import KVCache, KVCacheSpec, allocate_kv_cache
from cp_compile.metadata import (AttentionMetadata, BlockAllocator, CapacityError, MetadataError,
                                 build_attention_metadata, validate_step)
from cp_compile.parallel_state import ParallelState, destroy_parallel, get_parallel_state, init_parallel
from cp_compile.backend import CpAscendBackend, backend
from cp_compile.decorator import compile_model, cp_module
from cp_compile.sampling import RequestError, SamplingParams
# The front ends (transformers is imported only when a model is loaded).
from cp_compile.entrypoints.llm import LLM, CompletionOutput, RequestOutput

__all__ = [
    "AttentionMetadata", "AttentionSpec", "BlockAllocator", "CPConfig", "CapacityError", "ConfigError",
    "KVCache", "KVCacheSpec", "ParallelState", "allocate_kv_cache", "build_attention_metadata",
    "destroy_parallel", "get_parallel_state", "init_parallel", "CpAscendBackend", "backend", "compile_model",
    "cp_module", "MetadataError", "validate_step", "LLM", "RequestOutput", "CompletionOutput", "SamplingParams",
    "RequestError",
]

