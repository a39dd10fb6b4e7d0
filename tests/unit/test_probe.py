"""Reading vLLM's dev-mode /server_info (config_format=json) for what matters to PD; the pinned-ids probe."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web

from gateway.engines.client import EngineClient
from gateway.engines.engine import Engine
from gateway.engines.probe import honours_pinned_ids, kv_transfer_of


@pytest.mark.parametrize(("server_info", "expected"), [
    ({"vllm_config": {"kv_transfer_config": {
        "kv_connector": "NixlConnector", "kv_role": "kv_producer", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"bidirectional_kv_xfer": True}}}},
     {"connector": "NixlConnector", "role": "kv_producer", "failure_policy": "recompute", "bidirectional": True,
      "decoder_kv_blocks_ttl": None, "kv_lease_duration": None}),
    ({"vllm_config": {"kv_transfer_config": {"kv_connector": "NixlConnector", "kv_role": "kv_consumer",
                                             "kv_connector_extra_config": {"decoder_kv_blocks_ttl": 900}}}},
     {"connector": "NixlConnector", "role": "kv_consumer", "failure_policy": "fail", "bidirectional": False,
      "decoder_kv_blocks_ttl": 900.0, "kv_lease_duration": None}),
    ({"vllm_config": {"kv_transfer_config": None}}, None),       # an engine without a connector
    ({"vllm_config": "VllmConfig(model=...)"}, None),              # the text format
    ({}, None),
])
def test_kv_transfer_of(server_info, expected):
    assert kv_transfer_of(server_info) == expected


@pytest.mark.parametrize(("answer", "expected"), [
    ("pinned", True),          # vLLM 0.32+: the pinned ids are the prompt
    ("rendered", False),       # older vLLM: the messages' own rendering
    ("none", None),            # no ids in the answer: nothing proven
    ("error", None),           # HTTP 500: nothing proven
])
def test_honours_pinned_ids_reads_the_echoed_prompt(answer, expected):
    seen: list[dict] = []

    async def chat(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append(body)
        if answer == "error":
            return web.Response(status=500)
        ids = {"pinned": body["kv_transfer_params"]["prompt_token_ids"], "rendered": [1, 2, 3], "none": None}[answer]
        return web.json_response({"choices": [], **({"prompt_token_ids": ids} if ids else {})})

    async def scenario() -> bool | None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        try:
            async with aiohttp.ClientSession() as session:
                return await honours_pinned_ids(EngineClient(session), Engine(url, "prefill"),
                                                [{"role": "user", "content": "hi"}], [7, 8, 9], "m")
        finally:
            await runner.cleanup()

    assert asyncio.run(scenario()) is expected
    assert seen[0]["max_tokens"] == 1 and seen[0]["return_token_ids"] is True
    assert seen[0]["kv_transfer_params"] == {"prompt_token_ids": [7, 8, 9]}      # pins only: no transfer
