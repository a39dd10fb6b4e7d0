"""KV-event feeds follow the pools (engines/kv_feeds.py): an engine that joins a running gateway is subscribed where
`--kv-events` covers it, one that leaves is not, and one that comes back starts knowing nothing, whichever way it
came: DNS discovery (a `dns://NAME:PORT=tcp://*:PORT` entry, the nameserver of test_discovery.py), a SIGHUP reload
(a changed `kv_events` list included) or the admin API. The sims publish their prefix caches' events as vLLM does."""

from __future__ import annotations

import json
import signal
import socket
import threading
import urllib.request
import uuid

import httpx
import pytest
import yaml
import zmq
from dnslib.server import DNSLogger, DNSServer

from tests.e2e.stack import KV_EVENTS
from tests.e2e.test_discovery import ADMIN, INTERVAL_S, Records, pools, turn, wait_for
from tests.servers import Server, labelled_sum, start

pytestmark = pytest.mark.integration
PREFILL_NAME, DECODE_NAME = "pdgw-prefill.events.test", "pdgw-decode.events.test"
P0, D0, D1 = "127.0.0.12", "127.0.0.13", "127.0.0.14"


class Relay:
    """A pod's `tcp://*:PORT` as the gateway reaches it: at the pod's own address. The sims share one host, where
    only one of them could bind the port on every address, so each publishes on a loopback port of its own and this
    forwards its messages unchanged (topic, sequence number, batch) from ADDRESS:PORT."""

    def __init__(self, source: str, address: str, port: int) -> None:
        self.ctx = zmq.Context()
        self.sub, self.pub = self.ctx.socket(zmq.SUB), self.ctx.socket(zmq.PUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(source)
        self.pub.bind(f"tcp://{address}:{port}")
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stopping.is_set():
            if self.sub.poll(50):
                self.pub.send_multipart(self.sub.recv_multipart())

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join()
        self.ctx.destroy(linger=0)


def port_on(address: str, taken: int = 0) -> int:
    """A port free on `address` (and on the other loopback addresses: nothing else binds them), not `taken`."""
    while True:
        with socket.socket() as sock:
            sock.bind((address, 0))
            if sock.getsockname()[1] != taken:
                return sock.getsockname()[1]


def events_sim(role: str, address: str = "127.0.0.1", port: int = 0) -> Server:
    return start(["sim", "--role", role, "--engine-id", f"{role}-{address}-{port}", "--stream-kv-params",
                  "--kv-events-config", KV_EVENTS], host=address, port=port)


def stats(server: Server) -> dict:
    return httpx.get(server.url + "/sim/stats").json()


def kv_events(gateway: Server) -> dict[str, dict | None]:
    """Each engine's `kv_events` in /admin/engines (None: the gateway reads none of its events)."""
    seen = httpx.get(gateway.url + "/admin/engines", headers={"Authorization": f"Bearer {ADMIN}"}).json()
    return {e["url"]: e.get("kv_events") for e in seen["engines"]}


def knowledge_rows(gateway: Server, url: str) -> float:
    """1 while pdgw_kv_events_knowledge has the engine's row (one state of three is 1), 0 once it is gone."""
    request = urllib.request.Request(gateway.url + "/metrics", headers={"Authorization": f"Bearer {ADMIN}"})
    with urllib.request.urlopen(request, timeout=5) as answer:
        return labelled_sum(answer.read().decode(), "pdgw_kv_events_knowledge", {"engine": url})


@pytest.fixture(scope="module")
def dns_world():
    records = Records()
    dns_server = DNSServer(records, port=0, address="127.0.0.1", logger=DNSLogger("-request,-reply,-error", False))
    dns_server.start_thread()
    port = port_on(D0)
    kv_port = port_on(D0, taken=port)
    records.a = {PREFILL_NAME: [P0], DECODE_NAME: [D0]}
    servers: list[Server] = []
    relays: dict[str, Relay] = {}
    try:
        servers.append(start(["sim", "--role", "prefill", "--engine-id", "p0"], host=P0, port=port))
        for address in (D0, D1):
            servers.append(events_sim("decode", address, port))
            relays[address] = Relay(stats(servers[-1])["kv_events_endpoint"], address, kv_port)
        decode = f"dns://{DECODE_NAME}:{port}"
        servers.append(start([
            "serve", "--prefill", f"dns://{PREFILL_NAME}:{port}", "--decode", decode,
            "--kv-events", f"{decode}=tcp://*:{kv_port}", "--discovery-interval-s", str(INTERVAL_S),
            "--discovery-nameserver", f"127.0.0.1:{dns_server.server.server_address[1]}",
            "--health-interval-s", "0.5", "--reuse-policy", "always", "--local-prefill-max-tokens", "0",
            "--admin-key", ADMIN]))
        yield servers[-1], records, port
    finally:
        for server in reversed(servers):
            server.stop()
        for relay in relays.values():
            relay.stop()
        dns_server.stop()


def test_engines_found_by_dns_are_subscribed_as_they_join_and_not_after_they_leave(dns_world):
    gateway, records, port = dns_world
    d0, d1 = f"http://{D0}:{port}", f"http://{D1}:{port}"
    turn(gateway, "first", [{"role": "user", "content": "tell me about the rivers of the north"}])
    wait_for(lambda: (kv_events(gateway)[d0] or {}).get("knowledge") == "complete")
    assert kv_events(gateway)[d0]["blocks"] > 0

    records.a[DECODE_NAME] = [D1]                       # D0's pod goes, D1's comes
    wait_for(lambda: pools(gateway)["decode"] == {d1})
    assert knowledge_rows(gateway, d0) == 0 and knowledge_rows(gateway, d1) == 1
    turn(gateway, "second", [{"role": "user", "content": "what grows in the southern marshes"}])
    wait_for(lambda: kv_events(gateway)[d1]["knowledge"] == "complete")
    assert kv_events(gateway)[d1]["blocks"] > 0

    records.a[DECODE_NAME] = [D0]       # D0 back: what it was known to hold is not trusted again (nor said complete)
    wait_for(lambda: pools(gateway)["decode"] == {d0})
    assert kv_events(gateway)[d0]["knowledge"] != "complete" and knowledge_rows(gateway, d1) == 0
    turn(gateway, "third", [{"role": "user", "content": "who sails the eastern straits in winter"}])
    # its batches while away were missed: what it now stores is known, what it lacks is not
    wait_for(lambda: kv_events(gateway)[d0]["knowledge"] == "partial")
    assert kv_events(gateway)[d0]["blocks"] > 0


def test_a_reload_and_the_admin_api_follow_the_mapping(tmp_path):
    servers = [start(["sim", "--role", "prefill"]), events_sim("decode"), events_sim("decode")]
    p, d1, d2 = servers
    e1, e2 = (stats(d)["kv_events_endpoint"] for d in (d1, d2))
    own_host = f"tcp://*:{e2.rpartition(':')[2]}"          # d2's given as its own host's, vLLM's bind pasted
    settings = tmp_path / "gateway.yaml"

    def reload(decode: list[Server], entries: list[str]) -> None:
        settings.write_text(yaml.safe_dump({"prefill": [p.url], "decode": [d.url for d in decode],
                                            "kv_events": entries, "admin_key": ADMIN, "health_interval_s": 0.5}))
        servers[-1].proc.send_signal(signal.SIGHUP)

    settings.write_text(yaml.safe_dump({"prefill": [p.url], "decode": [d1.url], "admin_key": ADMIN}))
    servers.append(start(["serve", "--config", str(settings)]))
    gateway = servers[-1]
    try:
        assert kv_events(gateway)[d1.url] is None
        reload([d1, d2], [f"{d1.url}={e1}", f"{d2.url}={own_host}"])   # d1's mapping changes, d2 joins
        wait_for(lambda: all(kv_events(gateway).get(d.url) for d in (d1, d2)))
        for d in (d1, d2):               # a reset is one batch: each feed hears its own engine
            httpx.post(d.url + "/sim/reset").raise_for_status()
            wait_for(lambda d=d: kv_events(gateway)[d.url]["last_seq"] == stats(d)["kv_event_batches"] - 1)
        reload([d2], [f"{d2.url}={own_host}"])
        wait_for(lambda: set(kv_events(gateway)) == {p.url, d2.url})
        assert knowledge_rows(gateway, d1.url) == 0 and knowledge_rows(gateway, d2.url) == 1

        headers = {"Authorization": f"Bearer {ADMIN}"}
        engine = {"role": "decode", "url": d2.url}
        assert httpx.delete(gateway.url + "/admin/engines", headers=headers, params=engine).status_code == 200
        assert knowledge_rows(gateway, d2.url) == 0
        assert httpx.post(gateway.url + "/admin/engines", headers=headers, json=engine).status_code == 201
        assert kv_events(gateway)[d2.url]["knowledge"] != "complete"     # (its pinned-ids probe may be heard)
        answer = httpx.post(gateway.url + "/v1/chat/completions", headers={"X-Session-Id": uuid.uuid4().hex},
                            json={"model": "demo", "messages": [{"role": "user", "content": "lanterns at dusk"}]})
        assert answer.status_code == 200, answer.text
        wait_for(lambda: kv_events(gateway)[d2.url]["knowledge"] == "partial")   # batch 0 was the reset's
        assert kv_events(gateway)[d2.url]["blocks"] > 0
        assert "Traceback" not in gateway.log()
    finally:
        for server in reversed(servers):
            server.stop()
