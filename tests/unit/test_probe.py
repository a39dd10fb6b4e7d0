"""Reading vLLM's dev-mode /server_info (config_format=json) for what matters to PD."""

from __future__ import annotations

import pytest

from gateway.engines.probe import kv_transfer_of


@pytest.mark.parametrize(("server_info", "expected"), [
    ({"vllm_config": {"kv_transfer_config": {
        "kv_connector": "NixlConnector", "kv_role": "kv_producer", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"bidirectional_kv_xfer": True}}}},
     {"connector": "NixlConnector", "role": "kv_producer", "failure_policy": "recompute", "bidirectional": True,
      "decoder_kv_blocks_ttl": None}),
    ({"vllm_config": {"kv_transfer_config": {"kv_connector": "NixlConnector", "kv_role": "kv_consumer",
                                             "kv_connector_extra_config": {"decoder_kv_blocks_ttl": 900}}}},
     {"connector": "NixlConnector", "role": "kv_consumer", "failure_policy": "fail", "bidirectional": False,
      "decoder_kv_blocks_ttl": 900.0}),
    ({"vllm_config": {"kv_transfer_config": None}}, None),       # an engine without a connector
    ({"vllm_config": "VllmConfig(model=...)"}, None),              # the text format
    ({}, None),
])
def test_kv_transfer_of(server_info, expected):
    assert kv_transfer_of(server_info) == expected
