"""Engines found through DNS (issue 40): the gateway follows `dns://NAME:PORT` entries as a Kubernetes headless
Service's pods come and go. A real DNS server on loopback (dnslib) answers A records for two names; the simulated
engines listen on the addresses it gives (127.0.0.2, 127.0.0.3, ...: Linux routes 127/8 to lo), all on one port as
pods behind a Service do. The tests run in order on one gateway: the first set serves; a D added to the name joins
and takes turns; a D removed leaves while its stream finishes, and its conversation falls back; a nameserver that
goes silent changes nothing; a name that is gone (NXDOMAIN) empties its pool until a pod is back. Last, a second
gateway starts before its D's name exists and serves once it does."""

from __future__ import annotations

import concurrent.futures
import socket
import threading
import time
import urllib.request

import httpx
import openai
import pytest
from dnslib import QTYPE, RCODE, RR, A, DNSRecord
from dnslib.dns import DNSError
from dnslib.server import BaseResolver, DNSLogger, DNSServer

from tests.servers import Server, labelled_sum, start

pytestmark = pytest.mark.integration
ADMIN = "discovery-admin"
PREFILL_NAME, DECODE_NAME = "pdgw-prefill.test", "pdgw-decode.test"
P0, D0, D1 = "127.0.0.2", "127.0.0.3", "127.0.0.4"
INTERVAL_S = 0.3


class Records(BaseResolver):
    """The zone, changed by the tests: name → A records; an unknown name is NXDOMAIN. `silent`: no answer at all
    (the handler drops a query whose resolver raises DNSError), as a nameserver that stopped does."""

    def __init__(self) -> None:
        self.a: dict[str, list[str]] = {}
        self.silent = False
        self.dropped = 0

    def resolve(self, request: DNSRecord, handler) -> DNSRecord:
        if self.silent:
            self.dropped += 1
            raise DNSError("silent")
        reply = request.reply()
        addresses = self.a.get(str(request.q.qname).rstrip("."))
        if addresses is None:
            reply.header.rcode = RCODE.NXDOMAIN
        elif request.q.qtype == QTYPE.A:
            for address in addresses:
                reply.add_answer(RR(request.q.qname, QTYPE.A, rdata=A(address), ttl=1))
        return reply


def shared_port() -> int:
    """One port free on the engines' addresses (pods behind a Service listen on the same one)."""
    with socket.socket() as sock:
        sock.bind((D1, 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def world():
    records = Records()
    dns_server = DNSServer(records, port=0, address="127.0.0.1", logger=DNSLogger("-request,-reply,-error", False))
    dns_server.start_thread()
    port = shared_port()
    records.a = {PREFILL_NAME: [P0], DECODE_NAME: [D0]}
    engines: dict[str, Server] = {}
    gateway = None
    try:
        engines[P0] = start(["sim", "--role", "prefill", "--engine-id", "p0"], host=P0, port=port)
        engines[D0] = decode_sim(D0, port)
        nameserver = f"127.0.0.1:{dns_server.server.server_address[1]}"
        gateway = serve(port, nameserver, DECODE_NAME)
        yield gateway, records, engines, port, nameserver
    finally:
        if gateway is not None:
            gateway.stop()
        for server in engines.values():
            server.stop()
        dns_server.stop()


def serve(port: int, nameserver: str, decode_name: str) -> Server:
    return start(["serve", "--prefill", f"dns://{PREFILL_NAME}:{port}", "--decode", f"dns://{decode_name}:{port}",
                  "--discovery-nameserver", nameserver, "--discovery-interval-s", str(INTERVAL_S),
                  "--health-interval-s", "0.5", "--reuse-policy", "always", "--local-prefill-max-tokens", "0",
                  "--admin-key", ADMIN])


def decode_sim(address: str, port: int) -> Server:
    return start(["sim", "--role", "decode", "--engine-id", f"d-{address}", "--stream-kv-params"], host=address,
                 port=port)


def pools(gateway: Server) -> dict[str, set[str]]:
    """The gateway's engines now, by role (healthy ones)."""
    seen = httpx.get(gateway.url + "/admin/engines", headers={"Authorization": f"Bearer {ADMIN}"}).json()
    out: dict[str, set[str]] = {"prefill": set(), "decode": set()}
    for engine in seen["engines"]:
        if engine["healthy"]:
            out[engine["role"]].add(engine["url"])
    return out


def wait_for(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "not reached in time"
        time.sleep(0.05)


def turn(gateway: Server, session: str, messages: list[dict], max_tokens: int = 16) -> tuple[str, str, str]:
    """One turn: its answer, X-PD-Plan and X-PD-Reason; the answer is appended to `messages`."""
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=30)
    raw = client.chat.completions.with_raw_response.create(model="demo", messages=messages, max_tokens=max_tokens,
                                                           extra_headers={"X-Session-Id": session})
    text = raw.parse().choices[0].message.content or ""
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": f"go on ({len(messages)})"}]
    return text, raw.headers["X-PD-Plan"], raw.headers["X-PD-Reason"]


def requests_on(server: Server) -> int:
    return httpx.get(server.url + "/sim/stats").json()["requests_total"]


def engine_metric(gateway: Server, **labels: str) -> float:
    request = urllib.request.Request(gateway.url + "/metrics", headers={"Authorization": f"Bearer {ADMIN}"})
    with urllib.request.urlopen(request, timeout=5) as answer:
        return labelled_sum(answer.read().decode(), "pdgw_engine_healthy", labels)


HELD: list[dict] = [{"role": "user", "content": "tell me about the rivers of the north"}]


def test_turns_are_served_by_the_engines_the_names_resolve_to(world):
    gateway, _, engines, port, _ = world
    assert pools(gateway) == {"prefill": {f"http://{P0}:{port}"}, "decode": {f"http://{D0}:{port}"}}
    assert [turn(gateway, "held", HELD)[1] for _ in range(2)] == ["full", "reuse"]
    assert requests_on(engines[P0]) >= 1 and requests_on(engines[D0]) >= 2
    # named by the pod's address, not by the order engines joined in
    assert engine_metric(gateway, pool="decode", engine=f"decode-{D0}") == 1


def test_an_address_added_to_the_name_joins_and_takes_turns(world):
    gateway, records, engines, port, _ = world
    engines[D1] = decode_sim(D1, port)
    records.a[DECODE_NAME] = [D0, D1]
    wait_for(lambda: f"http://{D1}:{port}" in pools(gateway)["decode"])
    assert engine_metric(gateway, pool="decode", engine=f"decode-{D1}") == 1
    # D0 kept busy: a joining engine takes traffic gradually (its ramp), so new conversations spill over to D1
    httpx.post(engines[D0].url + "/sim/timing", json={"decode_ms_per_token": 30}).raise_for_status()
    try:
        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            plans = list(pool.map(lambda i: turn(gateway, f"new-{i}", [{"role": "user", "content": f"hi {i}"}],
                                                 max_tokens=24)[1], range(12)))
    finally:
        httpx.post(engines[D0].url + "/sim/timing", json={"decode_ms_per_token": 0}).raise_for_status()
    assert plans == ["full"] * 12
    assert requests_on(engines[D1]) >= 1


def test_an_address_removed_leaves_while_its_stream_finishes(world):
    gateway, records, engines, port, _ = world
    httpx.post(engines[D0].url + "/sim/timing", json={"decode_ms_per_token": 40}).raise_for_status()
    body = {"model": "demo", "messages": HELD, "stream": True, "max_tokens": 60}
    streamed: dict[str, str] = {}

    def stream() -> None:          # the held conversation's third turn: on D0, which holds its KV
        streamed["text"] = httpx.post(gateway.url + "/v1/chat/completions", json=body, timeout=30,
                                      headers={"X-Session-Id": "held"}).text

    before = requests_on(engines[D0])
    runner = threading.Thread(target=stream)
    runner.start()
    wait_for(lambda: requests_on(engines[D0]) > before)    # its D leg runs on D0
    before += 1
    records.a[DECODE_NAME] = [D1]
    wait_for(lambda: pools(gateway)["decode"] == {f"http://{D1}:{port}"})
    assert runner.is_alive(), "the stream ended before D0 left: nothing was tested"
    assert engine_metric(gateway, pool="decode", engine=f"decode-{D0}") == 0    # gone from /metrics
    runner.join()
    assert streamed["text"].rstrip().endswith("data: [DONE]") and '"error"' not in streamed["text"]
    # the conversation's D left: its next turn falls back with a reason, on D1, and stays correct
    HELD[-1:] = [{"role": "user", "content": "and the lakes?"}]
    _, plan, reason = turn(gateway, "held", HELD)
    assert (plan, reason) == ("full", "decode_unavailable")
    assert turn(gateway, "held", HELD)[1] == "reuse"
    assert requests_on(engines[D0]) == before                # D0 took nothing after it left
    assert sum(httpx.get(s.url + "/sim/stats").json()["kv_reads_corrupt"] for s in engines.values()) == 0


def test_a_silent_nameserver_keeps_the_last_set(world):
    gateway, records, _, port, _ = world
    wanted = {"prefill": {f"http://{P0}:{port}"}, "decode": {f"http://{D1}:{port}"}}
    assert pools(gateway) == wanted
    records.silent = True
    try:
        wait_for(lambda: records.dropped >= 4)             # each name asked twice and unanswered
        assert pools(gateway) == wanted
        assert turn(gateway, "silence", [{"role": "user", "content": "still there?"}])[1] == "full"
    finally:
        records.silent = False
    said = [line for line in gateway.log().splitlines() if "no answer within" in line]
    assert len(said) == 2, said                            # once per name, not once per look


def test_a_name_with_no_address_left_empties_its_pool(world):
    gateway, records, _, port, _ = world
    del records.a[DECODE_NAME]                             # NXDOMAIN: the Service has no ready pod
    wait_for(lambda: not pools(gateway)["decode"])
    answer = httpx.post(gateway.url + "/v1/chat/completions", timeout=30,
                        json={"model": "demo", "messages": [{"role": "user", "content": "anyone?"}], "max_tokens": 4})
    assert answer.status_code == 503
    records.a[DECODE_NAME] = [D1]                          # a pod ready again
    wait_for(lambda: pools(gateway)["decode"] == {f"http://{D1}:{port}"})
    assert turn(gateway, "back", [{"role": "user", "content": "anyone now?"}])[1] == "full"


def test_a_gateway_started_before_its_decode_pods_serves_once_they_are_ready(world):
    _, records, _, port, nameserver = world
    late = serve(port, nameserver, "pdgw-late.test")       # no such name yet: it starts with no D
    try:
        assert pools(late)["decode"] == set()
        records.a["pdgw-late.test"] = [D1]
        wait_for(lambda: pools(late)["decode"] == {f"http://{D1}:{port}"})
        assert turn(late, "late", [{"role": "user", "content": "hello"}])[1] == "full"
    finally:
        late.stop()
