"""`kv_transfer_config`: the vLLM-style role of an instance in PD disaggregation.

    kv_transfer_config={"kv_role": "kv_producer", "kv_connector": "NixlConnector",
                        "engine_id": "prefill-0", "kv_ip": "10.0.0.1", "kv_port": 5600}
    kv_transfer_config={"kv_role": "kv_consumer", "kv_connector": "NixlConnector",
                        "engine_id": "decode-0", "kv_ip": "10.0.0.1", "kv_port": 5600,
                        "kv_connector_extra_config": {"remote_engine_id": "prefill-0"}}

kv_ip / kv_port: the torch.distributed TCPStore both instances reach (agent metadata,
cache regions and finished requests are exchanged through it). Extra config:
`remote_engine_id` (consumer: the producer it reads from), `transfer_timeout_s`
(bound on one request's reads once the producer reported it ready, default 60),
`handoff_timeout_s` (how long one instance waits for the other: the consumer for a
request to become ready, the producer for the consumer's verdict before it frees
the request's blocks anyway; default 600), `store_master` (this process hosts the
store; else it connects to it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from cp_compile.errors import ConfigError

ROLES = ("kv_producer", "kv_consumer")
CONNECTORS = ("NixlConnector",)


@dataclass(frozen=True)
class KVTransferConfig:
    kv_role: str
    kv_connector: str = "NixlConnector"
    engine_id: str = "cp-engine"
    kv_ip: str = "127.0.0.1"
    kv_port: int = 0
    kv_connector_extra_config: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kv_role not in ROLES:
            raise ConfigError("kv_role is kv_producer | kv_consumer", f"kv_role={self.kv_role!r}",
                              "set kv_transfer_config['kv_role'] to 'kv_producer' (prefill instance) or "
                              "'kv_consumer' (decode instance)")
        if self.kv_connector not in CONNECTORS:
            raise ConfigError("kv_connector is one of the built transports", f"kv_connector={self.kv_connector!r}",
                              f"use one of {CONNECTORS} (a Mooncake / HCCL transport implements "
                              "cp_compile.kv_transfer.transport.KVTransport)")
        if not isinstance(self.kv_port, int) or isinstance(self.kv_port, bool) or not 0 < self.kv_port < 65536:
            raise ConfigError("kv_port is the store's TCP port", f"kv_port={self.kv_port!r}",
                              "set kv_port to the port of the TCPStore both instances reach (1..65535)")
        if self.kv_role == "kv_consumer" and not self.remote_engine_id:
            raise ConfigError("a kv_consumer names its producer", "kv_connector_extra_config has no remote_engine_id",
                              "set kv_connector_extra_config={'remote_engine_id': <the producer's engine_id>}")
        for name in ("transfer_timeout_s", "handoff_timeout_s"):
            t = getattr(self, name)
            if not isinstance(t, (int, float)) or isinstance(t, bool) or not t > 0:
                raise ConfigError(f"{name} > 0", f"{name}={t!r}",
                                  f"set kv_connector_extra_config['{name}'] to a positive number of seconds")

    @classmethod
    def from_dict(cls, d: "Mapping[str, Any] | KVTransferConfig") -> "KVTransferConfig":
        if isinstance(d, KVTransferConfig):
            return d
        known = {"kv_role", "kv_connector", "engine_id", "kv_ip", "kv_port", "kv_connector_extra_config"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError("kv_transfer_config has known keys only", f"unknown keys {unknown}",
                              f"use the keys {sorted(known)}")
        if "kv_role" not in d:
            raise ConfigError("kv_transfer_config has a kv_role", "no kv_role", "add 'kv_role'")
        return cls(**d)

    @property
    def is_producer(self) -> bool:
        return self.kv_role == "kv_producer"

    @property
    def remote_engine_id(self) -> str:
        return str(self.kv_connector_extra_config.get("remote_engine_id", ""))

    @property
    def transfer_timeout_s(self) -> float:
        return self.kv_connector_extra_config.get("transfer_timeout_s", 60.0)

    @property
    def handoff_timeout_s(self) -> float:
        return self.kv_connector_extra_config.get("handoff_timeout_s", 600.0)

    @property
    def store_master(self) -> bool:
        return bool(self.kv_connector_extra_config.get("store_master", False))
