"""PD disaggregation under context parallel: a prefill instance's KV into a decode
instance of any other layout (docs/kv_transfer.md).

- `layout`: `KVLayout` (one instance's tp, pcp, dcp, interleave, block size), `KVGeometry`
  (what both must agree on), `check_compatible`;
- `plan`: `plan_rank` (the reads of one decode rank: (src rank, src slot) -> dst slot runs
  from the two layouts' ownership math), `expected_bytes` (the formula);
- `regions`: cache tensors as regions, plans as byte descriptors;
- `transport`: the `KVTransport` interface and errors; `nixl`: the NIXL (UCX) transport;
- `exchange`: agent metadata, regions and finished requests through a TCPStore;
- `config`: `KVTransferConfig` (vLLM-style `kv_transfer_config`); `connector`: `KVProducer`,
  `KVConsumer`.
"""

from cp_compile.serving.kv_transfer.config import KVTransferConfig
from cp_compile.serving.kv_transfer.connector import ImportedRequest, KVConsumer, KVProducer
from cp_compile.serving.kv_transfer.layout import KVGeometry, KVLayout, check_compatible
from cp_compile.serving.kv_transfer.plan import RankPlan, SlotRun, expected_bytes, plan_rank
from cp_compile.serving.kv_transfer.transport import KVAlreadyImportedError, KVOwnershipError, KVTransferError, KVTransport

__all__ = ["ImportedRequest", "KVAlreadyImportedError", "KVConsumer", "KVGeometry", "KVLayout", "KVOwnershipError", "KVProducer",
           "KVTransferConfig", "KVTransferError", "KVTransport", "RankPlan", "SlotRun", "check_compatible",
           "expected_bytes", "plan_rank"]
