"""Reading vLLM's dev-mode /server_info (config_format=json) for what matters to PD; the pinned-ids probe."""

from __future__ import annotations

import asyncio
from dataclasses import asdict

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
     {"connector": "NixlConnector", "role": "kv_producer", "engine_id": None, "connectors": [],
      "failure_policy": "recompute", "bidirectional": True, "decoder_kv_blocks_ttl": None, "kv_lease_duration": None}),
    ({"vllm_config": {"kv_transfer_config": {"kv_connector": "NixlConnector", "kv_role": "kv_consumer",
                                             "kv_connector_extra_config": {"decoder_kv_blocks_ttl": 900}}}},
     {"connector": "NixlConnector", "role": "kv_consumer", "engine_id": None, "connectors": [],
      "failure_policy": "fail", "bidirectional": False, "decoder_kv_blocks_ttl": 900.0, "kv_lease_duration": None}),
    ({"vllm_config": {"kv_transfer_config": {   # push mode (docs/protocol.md §8.5), a MultiConnector's inner ones
        "kv_connector": "MultiConnector", "kv_role": "kv_consumer", "engine_id": "d0", "kv_connector_extra_config": {
            "kv_lease_duration": 20, "connectors": [{"kv_connector": "NixlPushConnector"}, {"kv_connector": "X"}]}}}},
     {"connector": "MultiConnector", "role": "kv_consumer", "engine_id": "d0",
      "connectors": ["NixlPushConnector", "X"], "failure_policy": "fail", "bidirectional": False,
      "decoder_kv_blocks_ttl": None, "kv_lease_duration": 20.0}),
    ({"vllm_config": {"kv_transfer_config": None}}, None),       # an engine without a connector
    ({"vllm_config": "VllmConfig(model=...)"}, None),              # the text format
    ({}, None),
])
def test_kv_transfer_of(server_info, expected):
    read = kv_transfer_of(server_info)
    assert (None if read is None else {**asdict(read), "connectors": list(read.connectors)}) == expected


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


@pytest.mark.parametrize(("behaviour", "expected", "calls"), [
    ("answer", {"vllm_config": {}}, 1),
    ("slow once", {"vllm_config": {}}, 2),   # a busy engine's late answer is waited for: it decides the mode
    ("404", None, 1),                        # no dev mode: shows nothing, asked once
    ("slow", None, 3),                       # never in time: given up after a few tries
])
def test_server_info_is_retried_when_slow_and_none_without_dev_mode(behaviour, expected, calls, monkeypatch):
    from gateway.engines import probe as probe_module
    monkeypatch.setattr(probe_module, "SERVER_INFO_TIMEOUT_S", 0.2)
    seen: list[int] = []

    async def server_info(request: web.Request) -> web.Response:
        seen.append(1)
        if behaviour == "404":
            return web.Response(status=404)
        if behaviour == "slow" or (behaviour == "slow once" and len(seen) == 1):
            await asyncio.sleep(1)
        return web.json_response({"vllm_config": {}})

    async def scenario() -> dict | None:
        app = web.Application()
        app.router.add_get("/server_info", server_info)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        try:
            async with aiohttp.ClientSession() as session:
                return await probe_module.server_info_of(EngineClient(session),
                                                         f"http://127.0.0.1:{runner.addresses[0][1]}")
        finally:
            await runner.cleanup()

    assert asyncio.run(scenario()) == expected and len(seen) == calls
