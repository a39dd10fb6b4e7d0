"""Simulated engines as real processes on loopback, and the few HTTP calls the sim tests make."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from tests.servers import Server, start

P_LEG_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                "remote_block_ids": None, "remote_host": None, "remote_port": None}


TOOL_FLAGS = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--tool-call-style", "varied")

# Every sim the suite uses, by name: started on first use, shared by all tests (each test resets what it uses).
FLEET: dict[str, tuple[str, ...]] = {
    "p": ("--role", "prefill"),  # defaults: policy fail, threshold 64
    "p_recompute": ("--role", "prefill", "--kv-load-failure-policy", "recompute", "--kv-recompute-threshold", "0"),
    "p_lease": ("--role", "prefill", "--kv-lease-duration", "0.6"),
    "p_oneway": ("--role", "prefill", "--no-bidirectional"),
    "d": ("--role", "decode"),
    "d_stream": ("--role", "decode", "--stream-kv-params"),
    "d_small": ("--role", "decode", "--num-blocks", "40", "--kv-recompute-threshold", "0"),
    "d_ttl": ("--role", "decode", "--decoder-kv-blocks-ttl", "0.6"),
    "d_tiny": ("--role", "decode", "--num-blocks", "48", "--decoder-kv-blocks-ttl", "2", "--output-tokens", "8:8",
               "--kv-lease-duration", "0.6"),  # D beats at the lease P uses: both read the same setting
    "d_slow": ("--role", "decode", "--decode-ms-per-token", "40", "--output-tokens", "40:40"),
    "c": ("--role", "colocated",),
    "c_reasoning": ("--role", "colocated", "--reasoning", "--tokenizer", "builtin:demo-reasoning"),
    "c_noncanonical": ("--role", "colocated", "--non-canonical", "--output-tokens", "30:40"),
    "c_old": ("--role", "colocated", "--no-prompt-token-ids"),
    # tools the model may call (vLLM's hermes parser), JSON that sometimes re-renders differently
    "c_tools": ("--role", "colocated", *TOOL_FLAGS),
    "p_tools": ("--role", "prefill", *TOOL_FLAGS),
    "d_tools": ("--role", "decode", *TOOL_FLAGS),
    # an agent loop that ends: always a call after the user speaks, text after two rounds (the demo's settings)
    "c_agent": ("--role", "colocated", *TOOL_FLAGS, "--tool-call-rate", "1.0", "--tool-call-rounds", "2"),
    # push mode (docs/protocol.md §8): no bidirectional transfer; D's watchdog short enough to see it fire
    "p_push": ("--role", "prefill", "--kv-transfer-mode", "push", "--no-bidirectional", "--kv-lease-duration", "3"),
    "d_push": ("--role", "decode", "--kv-transfer-mode", "push", "--no-bidirectional",
               "--push-registration-timeout", "1"),
}


class Fleet:
    def __init__(self) -> None:
        self.servers: dict[str, Server] = {}

    def __call__(self, *names: str) -> list[Server]:
        missing = [n for n in names if n not in self.servers]
        with ThreadPoolExecutor(max_workers=4) as pool:  # start-up is mostly waiting on imports
            for name, server in zip(missing, pool.map(lambda n: start(["sim", *FLEET[n]]), missing)):
                self.servers[name] = server
        return [self.servers[n] for n in names]

    def stop(self) -> None:
        for server in self.servers.values():
            server.stop()


@pytest.fixture(scope="session")
def fleet() -> Iterator[Fleet]:
    fleet = Fleet()
    try:
        yield fleet
    finally:
        fleet.stop()


@contextmanager
def running(*args: str) -> Iterator[Server]:
    server = start(["sim", *args])
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=30) as client:
        yield client


class Sims:
    """Helpers bound to one HTTP client."""

    def __init__(self, http: httpx.Client) -> None:
        self.http = http

    def chat(self, server: Server, messages: list[dict[str, Any]], **body: Any) -> dict[str, Any]:
        resp = self.http.post(server.url + "/v1/chat/completions",
                              json={"model": "demo", "messages": messages, **body})
        assert resp.status_code == 200, resp.text
        return resp.json()

    def post(self, server: Server, path: str, body: dict[str, Any], **kw: Any) -> httpx.Response:
        return self.http.post(server.url + path, json=body, **kw)

    def stats(self, server: Server) -> dict[str, Any]:
        return self.http.get(server.url + "/sim/stats").json()

    def raw_chat(self, server: Server, body: dict[str, Any], **kw: Any) -> httpx.Response:
        return self.http.post(server.url + "/v1/chat/completions", json={"model": "demo", **body}, **kw)

    def reset(self, *servers: Server) -> None:
        for server in servers:
            self.http.post(server.url + "/sim/reset").raise_for_status()

    def prefill(self, p: Server, messages: list[dict[str, Any]], handle: dict[str, Any] | None = None,
                **body: Any) -> dict[str, Any]:
        """A P leg as PROTOCOL §3 sends it; with `handle`, D's handle passed through (§4)."""
        params = dict(handle or P_LEG_PARAMS)
        params.update(do_remote_decode=True, do_remote_prefill=False)
        return self.chat(p, messages, max_tokens=1, stream=False, kv_transfer_params=params, **body)

    def decode(self, d: Server, messages: list[dict[str, Any]], p_handle: dict[str, Any],
               **body: Any) -> dict[str, Any]:
        return self.chat(d, messages, kv_transfer_params=p_handle, return_token_ids=True, **body)

    def turn(self, p: Server, d: Server, messages: list[dict[str, Any]], d_handle: dict[str, Any] | None = None,
             **body: Any) -> dict[str, Any]:
        # as the gateway sends them: min_tokens to D only (P generates one token; vLLM refuses min_tokens above it)
        p_resp = self.prefill(p, messages, d_handle, **{k: v for k, v in body.items() if k != "min_tokens"})
        assert p_resp["kv_transfer_params"] is not None
        return self.decode(d, messages, p_resp["kv_transfer_params"], **body)


@pytest.fixture(scope="session")
def sims(http: httpx.Client) -> Sims:
    return Sims(http)


def assistant(resp: dict[str, Any]) -> dict[str, str]:
    """The reply as a client would put it back into history."""
    return {"role": "assistant", "content": resp["choices"][0]["message"]["content"]}


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def long_text(words: int, tag: str = "") -> str:
    return " ".join(f"{tag}word{i}" for i in range(words))
