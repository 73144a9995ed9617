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

from cp_compile.base.errors import ConfigError

ROLES = ("kv_producer", "kv_consumer")
CONNECTORS = ("NixlConnector",)
EXTRA_KEYS = ("remote_engine_id", "transfer_timeout_s", "handoff_timeout_s", "store_master")


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
                              "cp_compile.serving.kv_transfer.transport.KVTransport)")
        if not isinstance(self.kv_port, int) or isinstance(self.kv_port, bool) or not 0 < self.kv_port < 65536:
            raise ConfigError("kv_port is the store's TCP port", f"kv_port={self.kv_port!r}",
                              "set kv_port to the port of the TCPStore both instances reach (1..65535)")
        if not isinstance(self.kv_ip, str) or not self.kv_ip:
            raise ConfigError("kv_ip is the store's host", f"kv_ip={self.kv_ip!r}",
                              "set kv_ip to the host of the TCPStore both instances reach, e.g. '127.0.0.1'")
        if not isinstance(self.engine_id, str) or not self.engine_id:
            raise ConfigError("engine_id names this instance", f"engine_id={self.engine_id!r}",
                              "set engine_id to a non-empty string unique among the instances")
        extra = self.kv_connector_extra_config
        if not isinstance(extra, Mapping):
            raise ConfigError("kv_connector_extra_config is a dict", f"kv_connector_extra_config={extra!r}",
                              f"pass a dict with keys among {list(EXTRA_KEYS)}")
        unknown = sorted(set(extra) - set(EXTRA_KEYS))
        if unknown:
            raise ConfigError("kv_connector_extra_config has known keys only", f"unknown keys {unknown}",
                              f"use the keys {list(EXTRA_KEYS)} (a misspelt timeout would silently keep the default)")
        if self.kv_role == "kv_consumer" and self.remote_engine_id == self.engine_id:
            raise ConfigError("a kv_consumer reads from another instance",
                              f"remote_engine_id={self.remote_engine_id!r} == engine_id",
                              "set remote_engine_id to the producer's engine_id and give this instance its own")
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
        if not isinstance(d, Mapping):
            raise ConfigError("kv_transfer_config is a dict (vLLM's keys)", f"kv_transfer_config={d!r}",
                              "pass e.g. {'kv_role': 'kv_producer', 'kv_connector': 'NixlConnector', "
                              "'kv_port': 5600}")
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
