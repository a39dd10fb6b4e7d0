"""`pd-gateway serve --workers N` (issue 40): N processes on one port over one Redis, simulated P and D.

What each process keeps for itself is either in the store or safe to keep per process, and each test here takes
a conversation from one worker to the other to show it: a session's handle (the store), a conversation found by
its tokens (each worker's recent holders miss, the store's prefix index finds it), a Responses chain (each
worker's chain cache misses, the stored response answers), the pin budget (each worker is a replica with its
share), /metrics (every worker's counters summed, whichever answers). A worker killed is replaced, SIGHUP
reloads every worker, SIGTERM stops them all.
"""

from __future__ import annotations

import http.client
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.redis_server import RedisServer
from tests.servers import labelled_sum, start

ADMIN = "workers-admin"
AUTH = {"Authorization": f"Bearer {ADMIN}"}
PIN_BUDGET = 0.5


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    servers = []
    with RedisServer() as redis:
        try:
            p = start(["sim", "--role", "prefill"])
            d = start(["sim", "--role", "decode", "--stream-kv-params"])
            d2 = start(["sim", "--role", "decode", "--stream-kv-params"])
            servers += [p, d, d2]
            config = tmp_path_factory.mktemp("workers") / "gateway.yaml"
            config.write_text(json.dumps({"prefill": [p.url], "decode": [d.url]}))
            gateway = start(["serve", "--workers", "2", "--config", str(config), "--redis-url", redis.url,
                             "--health-interval-s", "0.5", "--reuse-policy", "always",
                             "--local-prefill-max-tokens", "0", "--admin-key", ADMIN,
                             "--decode-pin-budget", str(PIN_BUDGET)])
            servers.append(gateway)
            yield gateway, config, d2
        finally:
            for server in reversed(servers):
                server.stop()


def on_worker(gateway, index: int) -> http.client.HTTPConnection:
    """A kept-alive connection that worker `index` accepted (the kernel spreads new connections over those
    listening: a worker still starting is not among them)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        conn = http.client.HTTPConnection("127.0.0.1", gateway.port, timeout=30)
        if call(conn, "GET", "/health")[1]["worker"] == index:
            return conn
        conn.close()
    raise AssertionError(f"no connection reached worker {index} in 60 s")


def call(conn: http.client.HTTPConnection, method: str, path: str, body: dict | None = None,
         headers: dict[str, str] | None = None) -> tuple[http.client.HTTPResponse, dict]:
    conn.request(method, path, json.dumps(body) if body is not None else None,
                 {"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    return resp, json.loads(resp.read() or b"{}")


def chat(conn, messages: list[dict], session: str | None) -> tuple[str, str]:
    """One turn; (X-PD-Plan, the answer)."""
    headers = {"X-Session-Id": session} if session else {}
    resp, body = call(conn, "POST", "/v1/chat/completions",
                      {"model": "demo", "messages": messages, "max_tokens": 16}, headers)
    assert resp.status == 200, body
    return resp.getheader("X-PD-Plan"), body["choices"][0]["message"]["content"]


def alternate(gateway, session: str | None, turns: int = 4) -> list[str]:
    """A conversation whose turns go to worker 0, 1, 0, 1...; each turn's plan."""
    conns = [on_worker(gateway, 0), on_worker(gateway, 1)]
    messages, plans = [{"role": "user", "content": f"hello {session}, tell me about the sea"}], []
    for turn in range(turns):
        plan, answer = chat(conns[turn % 2], messages, session)
        plans.append(plan)
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": f"and part {turn}?"}]
    return plans


def test_more_than_one_worker_needs_redis():
    run = subprocess.run([sys.executable, "-m", "gateway", "serve", "--workers", "2", "--prefill",
                          "http://127.0.0.1:9", "--decode", "http://127.0.0.1:9"], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode != 0
    assert run.stderr.strip().count("\n") == 0 and "workers" in run.stderr and "redis_url" in run.stderr


def test_a_session_reuses_whichever_worker_serves_its_turns(fleet):
    assert alternate(fleet[0], "alternating") == ["full", "reuse", "reuse", "reuse"]


def test_a_conversation_without_session_is_found_by_the_other_worker(fleet):
    # the second turn's worker never stored this conversation: its recent holders miss, the store finds it
    assert alternate(fleet[0], None) == ["full", "reuse", "reuse", "reuse"]


def test_a_responses_chain_continues_on_the_other_worker(fleet):
    gateway = fleet[0]
    first, body = call(on_worker(gateway, 0), "POST", "/v1/responses",
                       {"model": "demo", "input": "name three rivers", "max_output_tokens": 16})
    assert first.status == 200, body
    second, body = call(on_worker(gateway, 1), "POST", "/v1/responses",
                        {"model": "demo", "input": "and three seas", "previous_response_id": body["id"],
                         "max_output_tokens": 16})
    assert second.status == 200, body
    assert second.getheader("X-PD-Plan") == "reuse"


def test_metrics_are_every_workers_sum(fleet):
    gateway = fleet[0]
    before = [turns(on_worker(gateway, i)) for i in (0, 1)]
    alternate(gateway, "counted")
    after = [turns(on_worker(gateway, i)) for i in (0, 1)]
    assert before[0] == before[1] and after[0] == after[1] == before[0] + 4


def turns(conn) -> float:
    conn.request("GET", "/metrics", headers=AUTH)
    return labelled_sum(conn.getresponse().read().decode(), "pdgw_turns_total", {})


def test_each_worker_pins_its_share_of_ds_budget(fleet):
    """Two workers are two replicas: each pins half of D's budget (once each has heard the other's heartbeat)."""
    gateway = fleet[0]
    deadline = time.monotonic() + 20
    while (shares := [pin_share(on_worker(gateway, i)) for i in (0, 1)]) != [shares[0]] * 2 \
            or shares[0][0] != 2:
        assert time.monotonic() < deadline, shares
        time.sleep(0.5)
    replicas, share, blocks = shares[0]
    assert share == int(blocks * PIN_BUDGET / 2)


def pin_share(conn) -> tuple[int, int, int]:
    """(replicas this worker counts, its share of D's pin budget in blocks, D's KV blocks)."""
    _, body = call(conn, "GET", "/admin/engines", headers=AUTH)
    [decode] = [e for e in body["engines"] if e["role"] == "decode"]
    return decode["pin_share"]["replicas"], decode["pin_share"]["budget_blocks"], decode["num_gpu_blocks"]


def test_a_killed_worker_is_replaced(fleet):
    gateway = fleet[0]
    victim = worker_pid(gateway, 1)
    psutil.Process(victim).kill()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and worker_pid(gateway, 1) in (None, victim):
        time.sleep(0.2)
    assert worker_pid(gateway, 1) not in (None, victim)
    assert alternate(gateway, "after-kill")[1:] == ["reuse"] * 3


def worker_pid(gateway, index: int) -> int | None:
    for child in psutil.Process(gateway.proc.pid).children():
        try:
            if child.environ().get("PD_GATEWAY_WORKER") == str(index) and "spawn_main" in " ".join(child.cmdline()):
                return child.pid
        except psutil.Error:          # gone, or a zombie not yet reaped
            continue
    return None


def test_sighup_reloads_every_worker(fleet):
    gateway, config, d2 = fleet
    settings = json.loads(config.read_text())
    config.write_text(json.dumps({**settings, "decode": settings["decode"] + [d2.url]}))
    gateway.proc.send_signal(signal.SIGHUP)
    for index in (0, 1):
        conn = on_worker(gateway, index)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and d2.url not in engine_urls(conn):
            time.sleep(0.2)
        assert d2.url in engine_urls(conn), f"worker {index} did not reload"


def engine_urls(conn) -> set[str]:
    return {e["url"] for e in call(conn, "GET", "/admin/engines", headers=AUTH)[1]["engines"]}


def test_sigterm_stops_every_worker(fleet):
    gateway = fleet[0]
    children = psutil.Process(gateway.proc.pid).children()
    assert len(children) >= 2
    gateway.stop()
    assert gateway.proc.wait(timeout=60) == 0
    # multiprocessing's resource tracker, a child too, leaves once the supervisor's end of its pipe closes
    _, alive = psutil.wait_procs(children, timeout=10)
    assert not alive
    assert "Traceback" not in Path(gateway.log_path).read_text()
