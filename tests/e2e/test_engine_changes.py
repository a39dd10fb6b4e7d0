"""Engines join and leave a running gateway (admin API, SIGHUP config reload) without dropping turns."""

from __future__ import annotations

import signal
import threading
import time
import uuid

import httpx
import pytest
import yaml

from tests.e2e.stack import stack
from tests.servers import start

pytestmark = pytest.mark.integration
ADMIN = {"Authorization": "Bearer admin-secret"}


def engines(url: str) -> dict[str, dict]:
    return {e["url"]: e for e in httpx.get(url + "/admin/engines", headers=ADMIN).json()["engines"]}


def test_admin_adds_and_removes_engines_while_a_stream_runs():
    with stack(gateway=["--admin-key", "admin-secret"]) as s:
        extra = start(["sim", "--role", "decode", "--engine-id", "d-extra", "--stream-kv-params"])
        try:
            added = httpx.post(s.gateway.url + "/admin/engines", headers=ADMIN,
                               json={"role": "decode", "url": extra.url})
            assert added.status_code == 201 and added.json()["healthy"] is True
            assert engines(s.gateway.url)[extra.url]["role"] == "decode"
            httpx.post(s.decode[0].url + "/sim/timing", json={"decode_ms_per_token": 20}).raise_for_status()
            httpx.post(extra.url + "/sim/timing", json={"decode_ms_per_token": 20}).raise_for_status()
            body = {"model": "demo", "messages": [{"role": "user", "content": "a long story please"}],
                    "stream": True, "max_tokens": 40}
            result = {}

            def stream() -> None:
                result["text"] = httpx.post(s.gateway.url + "/v1/chat/completions", json=body, timeout=30).text

            runner = threading.Thread(target=stream)
            runner.start()
            time.sleep(0.3)
            for url in (s.decode[0].url, extra.url):    # whichever D serves the stream, both go away
                gone = httpx.delete(s.gateway.url + "/admin/engines", headers=ADMIN,
                                    params={"role": "decode", "url": url})
                assert gone.status_code == 200
            runner.join()
            assert result["text"].rstrip().endswith("data: [DONE]") and '"error"' not in result["text"]
            refused = httpx.post(s.gateway.url + "/v1/chat/completions", json={**body, "stream": False})
            assert refused.status_code == 503           # no decode engine left
            assert httpx.post(s.gateway.url + "/admin/engines", json={"role": "decode", "url": extra.url}) \
                .status_code == 401
        finally:
            extra.stop()


def test_sighup_reloads_the_engine_list(tmp_path):
    p = start(["sim", "--role", "prefill"])
    d1 = start(["sim", "--role", "decode", "--stream-kv-params"])
    d2 = start(["sim", "--role", "decode", "--stream-kv-params"])
    config = tmp_path / "gateway.yaml"
    config.write_text(yaml.safe_dump({"prefill": [p.url], "decode": [d1.url], "admin_key": "admin-secret"}))
    gateway = start(["serve", "--config", str(config)])
    try:
        config.write_text(yaml.safe_dump({"prefill": [p.url], "decode": [d2.url], "admin_key": "admin-secret"}))
        gateway.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while set(engines(gateway.url)) != {p.url, d2.url}:
            assert time.monotonic() < deadline, engines(gateway.url)
            time.sleep(0.1)
        def served() -> tuple[int, int]:     # a new engine also gets the pinned-ids probe's one-token request
            return tuple(httpx.get(d.url + "/sim/stats").json()["requests_total"] for d in (d1, d2))
        before = served()
        out = httpx.post(gateway.url + "/v1/chat/completions", headers={"X-Session-Id": uuid.uuid4().hex},
                         json={"model": "demo", "messages": [{"role": "user", "content": "hi"}]})
        assert out.status_code == 200
        after = served()
        assert after[0] == before[0] and after[1] > before[1]        # the turn went to the new D, not the old
    finally:
        for server in (gateway, p, d1, d2):
            server.stop()
