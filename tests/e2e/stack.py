"""A gateway with simulated P and D (and a co-located baseline engine) as real processes on loopback."""

from __future__ import annotations

import contextlib
import json
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import openai

from tests.servers import Server, labelled_sum, start


@dataclass
class Stack:
    prefill: list[Server]
    decode: list[Server]
    baseline: Server
    gateways: list[Server]

    @property
    def gateway(self) -> Server:
        return self.gateways[0]

    @property
    def engines(self) -> list[Server]:
        return [*self.prefill, *self.decode]

    def client(self, replica: int = 0) -> openai.OpenAI:
        url = self.gateways[replica % len(self.gateways)].url
        return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)

    def baseline_client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.baseline.url + "/v1", api_key="unused", max_retries=0, timeout=30)

    def stats(self, server: Server) -> dict:
        return get_json(server.url + "/sim/stats")

    def total(self, key: str) -> int:
        return sum(self.stats(s)[key] for s in [*self.engines, self.baseline])

    @staticmethod
    def wait_until(condition, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            if time.monotonic() > deadline:
                raise AssertionError("condition not reached in time")
            time.sleep(0.05)

    def metric(self, name: str, **labels: str) -> float:
        """The gateway's /metrics samples of `name` whose labels include `labels`, summed (0 when absent: a turn's
        families also carry its `model`); with an admin key configured, sent with it."""
        args = self.gateway.args
        key = args[args.index("--admin-key") + 1] if "--admin-key" in args else None
        request = urllib.request.Request(self.gateway.url + "/metrics",
                                         headers={"Authorization": f"Bearer {key}"} if key else {})
        text = urllib.request.urlopen(request, timeout=5).read().decode()
        return labelled_sum(text, name, labels)


KV_EVENTS = '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:*", "topic": "kv"}'


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.loads(resp.read())


@contextlib.contextmanager
def stack(*, sim: list[str] = (), decode: list[str] = ("--stream-kv-params",), gateway: list[str] = (),
          tokenizer: str = "builtin:demo", prefills: int = 1, decodes: int = 1, gateways: int = 1,
          local: bool = False, kv_events: bool = False) -> Iterator[Stack]:
    """`kv_events`: every sim publishes its KV events on a loopback port, and the gateway subscribes to them."""
    servers: list[Server] = []

    def launch(args: list[str]) -> Server:
        servers.append(start(args))
        return servers[-1]

    try:
        common = ["sim", "--tokenizer", tokenizer, *sim, *(["--kv-events-config", KV_EVENTS] if kv_events else [])]
        p = [launch([*common, "--role", "prefill", "--engine-id", f"p{i}"]) for i in range(prefills)]
        d = [launch([*common, "--role", "decode", "--engine-id", f"d{i}", *decode]) for i in range(decodes)]
        base = launch([*common, "--role", "colocated", "--engine-id", "baseline"])
        # these tests check reuse itself: `always`; the cost plan is tested on timed sims (test_cost_plan.py); P
        # reading D's KV unless `local` (the local path's own tests, test_local_path.py, and the property tests)
        args = ["serve", "--tokenizer", tokenizer, "--health-interval-s", "0.5", "--reuse-policy", "always",
                *([] if local else ["--local-prefill-max-tokens", "0"]), *gateway]
        for server in p:
            args += ["--prefill", server.url]
        for server in d:
            args += ["--decode", server.url]
        for server in (p + d if kv_events else []):
            args += ["--kv-events", f"{server.url}={get_json(server.url + '/sim/stats')['kv_events_endpoint']}"]
        yield Stack(p, d, base, [launch(args) for _ in range(gateways)])
    finally:
        for server in reversed(servers):
            server.stop()
