"""PD disaggregation on one rank of an `LLM` instance: the engine's KV role.

`attach` builds the `KVProducer` / `KVConsumer` (cp_compile.serving.kv_transfer) the
instance's `kv_transfer_config` names, over this rank's `hf.Engine` cache and block
allocator. The driver then sends the ranks, beside the step plans:

- `kv_export` (producer): requests whose prefill the last step finished; each rank
  publishes its block table and the sampled first token (`KVProducer.export`). The
  driver keeps the blocks reserved until the consumer's verdict (kv_driver.py).
- `kv_import` (consumer): requests to read from the producer into this rank's blocks,
  under the driver's own request ids (`KVConsumer.import_request`, collective over
  the instance's ranks, who agree on each request's verdict). A failed import is a
  reply, not a rank failure: the request's blocks were freed on every rank and the
  driver fails that request.
"""

from __future__ import annotations

from typing import Any

from cp_compile.base.errors import CapacityError, ConfigError
from cp_compile.serving.hf.engine import Engine, kv_cache_spec
from cp_compile.serving.kv_transfer import KVConsumer, KVProducer, KVTransferConfig, KVTransferError


def attach(engine: Engine, kv_transfer_config: Any) -> KVProducer | KVConsumer:
    """This rank's role over `engine`'s cache (`engine.kv_role`)."""
    kv = KVTransferConfig.from_dict(kv_transfer_config)
    state = engine.parallel  # the state the engine was built with (no global read here)
    rank, tp_rank = (state.rank, state.layout.tp.rank) if state is not None else (0, 0)
    spec = kv_cache_spec(engine.model.config, engine.config.tensor_parallel_size, tp_rank)
    if kv.is_producer:
        role: KVProducer | KVConsumer = KVProducer(kv, engine.config, engine.cache, spec, engine.spec, rank)
    else:
        role = KVConsumer(kv, engine.config, engine.cache, spec, engine.spec, rank, engine.alloc)
    engine.kv_role = role
    return role


def handle(engine: Any, kind: str, payload: Any) -> Any:
    """One driver command on this rank (kinds above)."""
    role = getattr(engine, "kv_role", None)
    if kind == "kv_export":
        if not isinstance(role, KVProducer):
            raise ConfigError("kv_export runs on a kv_producer instance", f"role {type(role).__name__}",
                              "start the instance with kv_transfer_config={'kv_role': 'kv_producer', ...}")
        for rid, num_tokens, first_token in payload:
            role.export(rid, num_tokens, engine.alloc.blocks(rid), first_token)
        return None
    if kind == "kv_import":
        if not isinstance(role, KVConsumer):
            raise ConfigError("kv_import runs on a kv_consumer instance", f"role {type(role).__name__}",
                              "start the instance with kv_transfer_config={'kv_role': 'kv_consumer', ...}")
        out = []
        for remote_id, local_id in payload:
            try:
                imp = role.import_request(remote_id, local_id=local_id)
            except (KVTransferError, ConfigError, CapacityError) as exc:  # every rank raises alike (agreement)
                out.append(dict(error=f"{type(exc).__name__}: {exc}"))
            else:
                out.append(dict(error=None, num_tokens=imp.num_tokens, first_token=imp.first_token,
                                bytes_moved=imp.bytes_moved, seconds=imp.seconds, src_ranks=imp.src_ranks,
                                descriptors=imp.descriptors))
        return out
    if kind == "kv_blocks":  # what the allocator holds (checks: a failed import leaves nothing behind)
        return dict(free=engine.alloc.num_free, num_blocks=engine.num_blocks,
                    quarantined=list(getattr(role, "quarantined", [])))
    raise ValueError(f"unknown driver command {kind!r}")
