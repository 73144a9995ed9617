"""kv_transfer_config refusals: each names the key, the value and the fix."""

from __future__ import annotations

import pytest

from cp_compile.base.errors import ConfigError
from cp_compile.serving.kv_transfer import KVTransferConfig

OK = {"kv_role": "kv_consumer", "kv_port": 5600, "kv_connector_extra_config": {"remote_engine_id": "p"}}


def test_accepts_vllm_style_dicts():
    c = KVTransferConfig.from_dict(OK)
    assert not c.is_producer and c.remote_engine_id == "p" and c.transfer_timeout_s == 60.0
    assert KVTransferConfig.from_dict({"kv_role": "kv_producer", "kv_port": 1}).is_producer
    assert KVTransferConfig.from_dict(c) is c


@pytest.mark.parametrize("change,needle", [
    ({"kv_role": "kv_both"}, "kv_role='kv_both'"),
    ({"kv_connector": "MooncakeConnector"}, "kv_connector='MooncakeConnector'"),
    ({"kv_port": 0}, "kv_port=0"),
    ({"kv_port": True}, "kv_port=True"),
    ({"kv_connector_extra_config": {}}, "no remote_engine_id"),
    ({"kv_connector_extra_config": {"remote_engine_id": "p", "transfer_timeout_s": 0}}, "transfer_timeout_s=0"),
    ({"kv_connector_extra_config": {"remote_engine_id": "p", "handoff_timeout_s": "10"}}, "handoff_timeout_s='10'"),
    ({"kv_buffer_size": 1}, "unknown keys ['kv_buffer_size']"),
    ({"kv_connector_extra_config": {"remote_engine_id": "p", "transfer_timeout": 5}}, "unknown keys ['transfer_timeout']"),
    ({"kv_connector_extra_config": "remote=p"}, "kv_connector_extra_config='remote=p'"),
    ({"engine_id": "p"}, "remote_engine_id='p' == engine_id"),
    ({"kv_ip": ""}, "kv_ip=''"),
    ({"engine_id": ""}, "engine_id=''"),
])
def test_refusals_name_key_value_and_fix(change, needle):
    with pytest.raises(ConfigError, match="Fix: ") as e:
        KVTransferConfig.from_dict({**OK, **change})
    assert needle in str(e.value)
    with pytest.raises(ConfigError, match="kv_role"):
        KVTransferConfig.from_dict({"kv_port": 1})


def test_a_non_dict_is_refused():
    with pytest.raises(ConfigError, match="kv_transfer_config is a dict") as e:
        KVTransferConfig.from_dict("kv_producer")
    assert "kv_transfer_config='kv_producer'" in str(e.value) and "Fix: " in str(e.value)
