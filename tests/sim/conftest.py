"""Simulated engines as real processes on loopback, and the few HTTP calls the sim tests make."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from tests.servers import Server, start

P_LEG_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                "remote_block_ids": None, "remote_host": None, "remote_port": None}


@contextmanager
def running(*args: str) -> Iterator[Server]:
    server = start(["sim", *args])
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
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
        p_resp = self.prefill(p, messages, d_handle, **body)
        assert p_resp["kv_transfer_params"] is not None
        return self.decode(d, messages, p_resp["kv_transfer_params"], **body)


@pytest.fixture(scope="module")
def sims(http: httpx.Client) -> Sims:
    return Sims(http)


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def long_text(words: int, tag: str = "") -> str:
    return " ".join(f"{tag}word{i}" for i in range(words))
