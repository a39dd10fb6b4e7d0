"""A gateway exposed to hostile clients (issue 38): slow and stuck sockets are closed while others are served,
the connection cap answers 503, what the HTTP parser refuses is in the API's error shape, and the operational
paths are open only where docs/operations.md#paths-and-who-may-call-them says."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from gateway.api.auth import digest
from gateway.processes import free_port
from tests.e2e.stack import stack

pytestmark = pytest.mark.integration
CHAT = {"model": "demo", "max_tokens": 8, "messages": [{"role": "user", "content": "hello there"}]}


def _connect(port: int, data: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    if data:
        sock.sendall(data)
    return sock


def _until_closed(sock: socket.socket, within_s: float) -> bytes | None:
    """What the server sent before closing; None if it kept the socket open `within_s`."""
    sock.settimeout(0.5)
    got, deadline = b"", time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            continue
        except ConnectionResetError:
            return got
        if not chunk:
            return got
        got += chunk
    return None


def _status_and_error(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), json.loads(body)


def test_slow_clients_are_closed_while_others_are_served():
    """60 half-sent headers, 20 partial bodies (Content-Length: 100000) and 5 silent connections stayed open
    for good under uvicorn alone; each is now answered 408 and closed, and turns go on meanwhile."""
    with stack(gateway=["--header-timeout-s", "1", "--body-timeout-s", "2"]) as s:
        port = s.gateway.port
        headers = [_connect(port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Ty") for _ in range(60)]
        bodies = [_connect(port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                                 b"\r\nContent-Length: 100000\r\n\r\n{\"model\": ") for _ in range(20)]
        silent = [_connect(port, b"") for _ in range(5)]
        for _ in range(3):
            assert httpx.post(s.gateway.url + "/v1/chat/completions", json=CHAT, timeout=30).status_code == 200
        began = time.monotonic()
        for sock in [*headers, *bodies, *silent]:
            raw = _until_closed(sock, within_s=30)
            assert raw is not None, "a slow client's socket stayed open"
            status, error = _status_and_error(raw)
            assert status == 408 and error["error"]["code"] == "request_timeout", raw
            sock.close()
        assert time.monotonic() - began < 30
        assert httpx.post(s.gateway.url + "/v1/chat/completions", json=CHAT, timeout=30).status_code == 200
        assert "Traceback" not in s.gateway.log()


MALFORMED = [
    b"GET /health HTTP/1.1\r\nHost: x\rX-A: b\r\n\r\n",                    # bare CR
    b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: b\x00c\r\n\r\n",              # NUL in a value
    b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: b\r\n folded\r\n\r\n",       # obsolete line folding
    b"GET /health HTTP/1.1\r\nHost: x\r\nX-\xff: b\r\n\r\n",                # 0xff in a header name
    b"GET /health HTTP/1.1\r\nHost: x\r\nX\x7f: b\r\n\r\n",                 # DEL in a header name
    b"GET /he alth HTTP/1.1\r\nHost: x\r\n\r\n",                            # a malformed request line
    b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03",                        # TLS to a plain-HTTP port
]


@pytest.fixture(scope="module")
def pd():
    with stack() as s:
        yield s


@pytest.mark.parametrize("raw", MALFORMED, ids=range(len(MALFORMED)))
def test_what_the_http_parser_refuses_is_in_the_api_error_shape(pd, raw):
    answer = _until_closed(_connect(pd.gateway.port, raw), within_s=15)
    assert answer is not None and answer.startswith(b"HTTP/1.1 400 "), answer
    status, error = _status_and_error(answer)
    assert status == 400 and {"message", "type", "param", "code"} <= set(error["error"]), error
    assert b"connection: close" in answer.lower()


def test_on_the_messages_path_the_refusal_is_anthropics(pd):
    raw = b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nX-A: b\x00c\r\n\r\n"
    status, error = _status_and_error(_until_closed(_connect(pd.gateway.port, raw), within_s=15))
    assert status == 400 and error["type"] == "error" and error["error"]["type"] == "invalid_request_error"


def test_above_the_connection_cap_a_new_connection_gets_503():
    with stack(gateway=["--max-connections", "8"]) as s:
        held, refused = [], None
        for _ in range(12):
            sock = _connect(s.gateway.port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")   # kept alive after it
            answer = sock.recv(65536)
            if answer.startswith(b"HTTP/1.1 503"):
                refused = answer
                break
            assert answer.startswith(b"HTTP/1.1 200"), answer
            held.append(sock)
        assert refused is not None and len(held) == 8
        assert _status_and_error(refused)[1]["error"]["code"] == "too_many_connections"
        for sock in held:
            sock.close()
        s.wait_until(lambda: httpx.get(s.gateway.url + "/health", timeout=5).status_code == 200)


def _get(url: str, key: str | None = None) -> httpx.Response:
    return httpx.get(url, headers={"Authorization": f"Bearer {key}"} if key else {}, timeout=10)


def test_with_keys_metrics_and_openapi_need_the_admin_key():
    with stack(gateway=["--api-keys", f"team:{digest('client-key')}", "--admin-key", "admin-key"]) as s:
        for path in ("/metrics", "/openapi.json"):
            for key in (None, "client-key", "wrong"):
                refused = _get(s.gateway.url + path, key)
                assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"
            assert _get(s.gateway.url + path, "admin-key").status_code == 200
        text = _get(s.gateway.url + "/metrics", "admin-key").text
        assert 'engine="prefill-0"' in text and 'engine="decode-0"' in text
        assert "127.0.0.1" not in text and "http://" not in text
        for path in ("/health", "/ready"):
            assert _get(s.gateway.url + path).status_code == 200
        assert set(_get(s.gateway.url + "/ready").json()) == {"ready", "store", "store_ok", "degraded"}


def test_with_client_keys_and_no_admin_key_metrics_say_how_to_reach_them():
    with stack(gateway=["--api-keys", f"team:{digest('client-key')}"]) as s:
        refused = _get(s.gateway.url + "/metrics", "client-key")
        assert refused.status_code == 401 and "--metrics-port" in refused.json()["error"]["message"]


def test_the_metrics_listener_serves_only_the_operational_paths():
    port = free_port()
    with stack(gateway=["--api-keys", f"team:{digest('client-key')}", "--metrics-port", str(port)]) as s:
        metrics = f"http://127.0.0.1:{port}"
        text = _get(metrics + "/metrics").text
        assert "pdgw_turns_total" in text and 'engine="prefill-0"' in text
        assert _get(metrics + "/openapi.json").json()["openapi"].startswith("3.")
        assert _get(metrics + "/health").status_code == 200 and _get(metrics + "/ready").status_code == 200
        for path in ("/v1/models", "/admin/engines"):
            assert _get(metrics + path, "client-key").status_code == 404
        assert _get(s.gateway.url + "/metrics", "client-key").status_code == 404      # not on the API's port
        assert _get(s.gateway.url + "/v1/models", "client-key").status_code == 200
