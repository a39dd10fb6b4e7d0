"""Chaos run: several gateway replicas on one real Redis, 2 simulated P and 2 simulated D, a few hundred
concurrent multi-turn conversations, while engines of each role are killed and restarted, Redis restarts,
clients disconnect mid-stream, turns of one session race, an engine turns slow past its deadline, and bad
input keeps coming. Then the simulators' oracle and the clients' own records are checked.

    python bench/chaos.py [--quick] [--kv-events] [--models 2] [--redis cluster] [--clients N]

--kv-events: every engine publishes its KV events through a relay that drops, delays and reorders them
(bench/event_relay.py), and the gateways plan from them (issue 36): still 0 corrupt.
--models 2: two models behind the gateways (issue 39: a settings file's `models`), `demo` on P0 and D0 and
`demo-b` on P1 and D1, each conversation with one of them: still 0 corrupt, no conversation crossing over.
--redis cluster: the store a Redis Cluster of three masters with a replica each; a gateway replica killed
mid-stream and restarted, and a master's crash failed over, take the place of Redis' restart (issue 40,
bench/chaos_cluster.py): still 0 corrupt, reuse after each fault, every D's pin-budget shares summing to its
budget. Its findings are the line before the last (`cluster: interrupted=N ... shares_end=ok`).

Last line: chaos: turns=N corrupt=0 stale_reads=0 hung=0 leaked_pins=0 bad_input_5xx=0 non_openai_errors=0 reuse_rate=R
`stale_reads`: reads of a handle already spent on its D (or P), or never issued there: garbage on vLLM, a gateway bug
even while the blocks still hold the right KV (corrupt=0). The harmless claims of a spent handle, notifications
(a release sent again), are on the `double reads:` line (docs/protocol.md §4).
Above it, one line per fallback reason of the later turns that did not reuse (`fallback REASON: N`), most first.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import sys
import tempfile
import time
import uuid
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import zmq.asyncio  # noqa: E402

from bench import chaos_cluster  # noqa: E402
from bench.chaos_client import HUNG_S, MODELS, Tally, check_error, turn  # noqa: E402
from bench.chaos_cluster import ClusterFindings  # noqa: E402
from bench.event_relay import EventRelay  # noqa: E402
from gateway.config import DEFAULT_DECODE_PIN_BUDGET  # noqa: E402
from gateway.processes import Server, start  # noqa: E402
from tests.redis_cluster import RedisCluster  # noqa: E402
from tests.redis_server import RedisServer  # noqa: E402

TTL_S = 8                      # D pins and P leases are short so that leaks would show within the run
D_LEASE_S = 2 * TTL_S          # D's lease (a local turn's handle): long enough that local turns happen
GATEWAY_FLAGS = ["--prefill-timeout-s", "4", "--prefill-handle-timeout-s", "3", "--decode-first-byte-timeout-s", "4", "--decode-idle-timeout-s",
                 "1.5", "--max-retries", "2", "--decoder-kv-blocks-ttl-s", str(TTL_S), "--handle-ttl-margin-s",
                 "3", "--health-interval-s", "0.5", "--log-level", "warning", "--reuse-policy", "always",
                 "--decode-kv-lease-s", str(D_LEASE_S)]
SIM_FLAGS = ["--output-tokens", "70:110", "--kv-lease-duration", str(TTL_S), "--decoder-kv-blocks-ttl",
             str(TTL_S), "--log-level", "warning"]
DOUBLE_READS = ("handles_reread", "handles_read_unknown", "handles_renotified", "handles_notified_unknown")
STALE_READS = DOUBLE_READS[:2]  # the reads among them; the others are notifications, which D ignores
RECENT: list[str] = []         # session ids of recent conversations (--models 2 gives some to another model too)
WORDS = "cache block token engine stream prefix decode prefill lease handle answer model river orbit".split()
BAD_INPUTS = [b"{nope", b"[]", b'{"model":"demo"}', b'{"messages":"x"}', b'{"messages":[{"role":1}]}',
              b'{"model":"demo","messages":[{"role":"user","content":"x"}],"n":4}',
              b'{"model":"other","messages":[{"role":"user","content":"x"}]}',
              b'{"model":"demo","messages":[{"role":"user","content":"x"}],"max_tokens":-3}']


class Fleet:
    def __init__(self, replicas: int, relays: dict[str, EventRelay] | None = None, models: int = 1,
                 cluster: bool = False) -> None:
        self.relays = relays or {}
        self.models = MODELS[:models]          # engine pair i serves models[i % len(models)]
        self.redis = RedisCluster(masters=3, replicas=1).start() if cluster else RedisServer().start()
        self.dead_stats: list[dict] = []
        self.prefill = [self._sim("prefill", f"p{i}") for i in range(2)]
        self.decode = [self._sim("decode", f"d{i}") for i in range(2)]
        self.killed: dict[str, float] = {}     # gateway replicas' URLs: when last killed
        self.down: set[str] = set()            # ... those down now
        self.findings = ClusterFindings()
        self.gateways = [self.gateway() for _ in range(replicas)]

    def gateway(self, port: int = 0) -> Server:
        return start(["serve", *self._engines(), "--redis-url", self.redis.url, "--admin-key",
                      chaos_cluster.ADMIN_KEY, *GATEWAY_FLAGS], port=port)

    @property
    def pin_budget(self) -> float:
        given = "--decode-pin-budget" in GATEWAY_FLAGS
        return float(GATEWAY_FLAGS[GATEWAY_FLAGS.index("--decode-pin-budget") + 1]) if given else DEFAULT_DECODE_PIN_BUDGET

    def _events(self, pair: int) -> list[str]:
        """The KV-event subscriptions of engine pair `pair` (P, D), where they publish through a relay."""
        return [f"{server.url}={self.relays[name].outlet}"
                for name, server in ((f"p{pair}", self.prefill[pair]), (f"d{pair}", self.decode[pair]))
                if name in self.relays]

    def _engines(self) -> list[str]:
        """The gateways' engines: as flags for one model; for two, a settings file giving each its own pair."""
        if len(self.models) == 1:
            return [*(a for s in self.prefill for a in ("--prefill", s.url)),
                    *(a for s in self.decode for a in ("--decode", s.url)),
                    *(a for pair in range(2) for e in self._events(pair) for a in ("--kv-events", e))]
        path = Path(tempfile.mkdtemp(prefix="chaos-")) / "models.yaml"           # JSON is YAML
        path.write_text(json.dumps({"models": [
            {"name": model, "prefill": [self.prefill[i].url], "decode": [self.decode[i].url],
             "kv_events": self._events(i)} for i, model in enumerate(self.models)]}))
        return ["--config", str(path)]

    def _sim(self, role: str, name: str, port: int = 0) -> Server:
        # A restarted engine gets a new engine id, as vLLM does unless one is configured. Both legs under `fail`
        # (docs/vllm-findings.md #8: vLLM parks a declined read under `recompute`).
        relay = self.relays.get(name)
        events = ["--kv-events-config", json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                                    "endpoint": relay.inlet})] if relay else []
        model = self.models[int(name[1:]) % len(self.models)]
        return start(["sim", "--role", role, "--engine-id", f"{name}-{uuid.uuid4().hex[:6]}", "--model", model,
                      "--kv-load-failure-policy", "fail", "--stream-kv-params", *SIM_FLAGS, *events,
                      *(["--kv-lease-duration", str(D_LEASE_S)] if role == "decode" else [])], port=port)

    @property
    def sims(self) -> list[Server]:
        return [*self.prefill, *self.decode]

    async def restart(self, pool: list[Server], index: int, down_s: float) -> None:
        old = pool[index]
        self.dead_stats.append(await stats(old))
        old.stop(signal.SIGKILL)
        await asyncio.sleep(down_s)
        role = "prefill" if pool is self.prefill else "decode"
        pool[index] = await asyncio.to_thread(self._sim, role, f"{role[0]}{index}", old.port)

    def stop(self) -> None:
        for server in [*self.gateways, *self.sims]:
            server.stop()
        self.redis.stop()


async def stats(server: Server) -> dict:
    async with aiohttp.ClientSession() as http, http.get(server.url + "/sim/stats") as resp:
        return await resp.json()


async def set_timing(server: Server, **timing: float) -> None:
    async with aiohttp.ClientSession() as http, http.post(server.url + "/sim/timing", json=timing) as resp:
        resp.raise_for_status()


async def conversations(http: aiohttp.ClientSession, fleet: Fleet, turns: int, tally: Tally,
                        stop: asyncio.Event) -> None:
    """One client: conversation after conversation of `turns` turns, until told to stop."""
    while not stop.is_set():
        await conversation(http, fleet, turns, tally)


async def conversation(http: aiohttp.ClientSession, fleet: Fleet, turns: int, tally: Tally) -> None:
    model = random.choice(fleet.models)
    # with two models, now and then a session id another model's conversation uses too: two conversations
    session = random.choice(RECENT) if len(fleet.models) > 1 and RECENT and random.random() < 0.2 else uuid.uuid4().hex
    RECENT.append(session)
    del RECENT[:-64]
    messages: list[dict] = []
    for _ in range(turns):
        messages.append({"role": "user", "content": " ".join(random.choices(WORDS, k=random.randint(8, 40)))})
        if random.random() < 0.05:          # two turns of one session at once
            answers = await asyncio.gather(turn(http, fleet, session, list(messages), tally, model=model),
                                           turn(http, fleet, session, list(messages), tally, model=model))
            answer = next((a for a in answers if a is not None), None)
        else:
            answer = await turn(http, fleet, session, messages, tally, disconnect=random.random() < 0.05,
                                model=model)
        if answer is None:
            messages.pop()
            continue
        messages.append({"role": "assistant", "content": answer})


async def bad_input(http: aiohttp.ClientSession, fleet: Fleet, tally: Tally, stop: asyncio.Event) -> None:
    while not stop.is_set():
        replica, began = random.choice([g.url for g in fleet.gateways if g.url not in fleet.down]), time.monotonic()
        try:
            async with http.post(replica + "/v1/chat/completions", data=random.choice(BAD_INPUTS),
                                 headers={"Content-Type": "application/json"}) as resp:
                payload = await resp.json(content_type=None)
                tally.bad_input_5xx += resp.status >= 500
                check_error(payload, tally, f"bad input HTTP {resp.status}")
        except aiohttp.ClientError as exc:
            if chaos_cluster.cut(fleet, replica, began):
                tally.interrupted += 1
                continue
            tally.non_openai_errors += 1
            tally.notes.append(f"bad input transport: {exc!r}")
        await asyncio.sleep(0.05)


FAULTS = [
    ("kill P0, restart it 2 s later", lambda fleet, period: fleet.restart(fleet.prefill, 0, down_s=2)),
    ("restart Redis", lambda fleet, period: asyncio.to_thread(fleet.redis.restart)),
    ("kill D1, restart it 2 s later", lambda fleet, period: fleet.restart(fleet.decode, 1, down_s=2)),
    ("slow D0 past its deadlines", lambda fleet, period: slow(fleet.decode[0], period)),
]


def schedule(cluster: bool) -> list:
    """On Redis Cluster a replica's kill and a master's failover take the place of the one Redis' restart."""
    if not cluster:
        return FAULTS
    kill, failover = chaos_cluster.faults()
    return [FAULTS[0], kill, FAULTS[2], failover, FAULTS[3]]


async def faults(fleet: Fleet, period: float, log: list[str], tally: Tally, plan: list) -> None:
    for name, action in plan:
        await asyncio.sleep(period)
        at = time.monotonic() - tally.began
        log.append(f"{time.strftime('%H:%M:%S')} +{at:.0f}s {name}")
        await action(fleet, period)
        tally.fault_times.append((name, at, time.monotonic() - tally.began))


async def slow(server: Server, seconds: float) -> None:
    await set_timing(server, decode_ms_per_token=2500)
    await asyncio.sleep(seconds)
    await set_timing(server, decode_ms_per_token=0)


async def settle(fleet: Fleet, tally: Tally) -> None:
    """After the TTLs, no engine may still pin or lease blocks; then sum the oracle's corrupt reads."""
    deadline = time.monotonic() + 2 * TTL_S + 5
    while True:
        current = await asyncio.gather(*(stats(s) for s in fleet.sims))
        held = sum(s["handles_pinned"] + s["handles_leased_now"] for s in current)
        if held == 0 or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.5)
    tally.leaked_pins = held
    every = [*current, *fleet.dead_stats]
    tally.corrupt = sum(s["kv_reads_corrupt"] for s in every)
    tally.double_reads.update({k: sum(s[k] for s in every) for k in DOUBLE_READS})
    for s in every:
        keys = ("kv_reads_corrupt", "requests_corrupt", "handles_double_read", *DOUBLE_READS,
                "handles_read_after_expiry", "kv_reads_declined", "kv_load_failures", "requests_aborted",
                "handles_expired")
        tally.notes.append(f"{s['engine_id']}: " + " ".join(f"{k}={s[k]}" for k in keys))


async def run(clients: int, turns: int, fault_period: float, replicas: int, kv_events: bool = False,
              models: int = 1, cluster: bool = False) -> Tally:
    ctx = zmq.asyncio.Context()
    relays = {name: EventRelay(ctx, rng=random.Random(i)) for i, name in enumerate(("p0", "p1", "d0", "d1"))} \
        if kv_events else {}
    for relay in relays.values():
        relay.start()
    fleet = await asyncio.to_thread(Fleet, replicas, relays, models, cluster)
    tally, fault_log, stop, plan = Tally(), [], asyncio.Event(), schedule(cluster)
    try:
        timeout = aiohttp.ClientTimeout(total=HUNG_S + 30)
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as http:
            noise = asyncio.create_task(bad_input(http, fleet, tally, stop))
            began = tally.began = time.monotonic()
            chaos = asyncio.create_task(faults(fleet, fault_period, fault_log, tally, plan))
            load = asyncio.gather(*(conversations(http, fleet, turns, tally, stop) for _ in range(clients)))
            await chaos
            await asyncio.sleep(fault_period)                   # load before, during and after every fault
            stop.set()
            await load
            await noise
            elapsed = time.monotonic() - began
        await settle(fleet, tally)
        if cluster:
            await chaos_cluster.check(fleet, tally, fault_period)
            tally.cluster = fleet.findings.line(tally.interrupted)
    finally:
        fleet.stop()
        for relay in relays.values():
            await relay.stop()
        ctx.term()
    print("\n".join(fault_log))
    for line in fleet.findings.trace:
        print("pin shares settling:", line)
    if relays:
        print("kv events:", {name: relay.counts for name, relay in relays.items()})
    print(f"load: {tally.turns} turns in {elapsed:.1f}s, {tally.failed} failed with an OpenAI error, "
          f"{tally.disconnects} client disconnects")
    print("errors:", dict(tally.errors.most_common()))
    print("timeline:", sorted(tally.timeline.items()))
    if tally.seconds:
        ordered = sorted(tally.seconds)
        print(f"turn seconds: p50={ordered[len(ordered) // 2]:.2f} p90={ordered[len(ordered) * 9 // 10]:.2f} "
              f"max={ordered[-1]:.2f}")
    print("double reads:", " ".join(f"{k.removeprefix('handles_')}={tally.double_reads[k]}" for k in DOUBLE_READS))
    for note in tally.notes[-12:]:
        print("note:", note)
    return tally


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="about 2 minutes")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--kv-events", action="store_true",
                        help="engines publish KV events through a relay that drops, delays and reorders them")
    parser.add_argument("--models", type=int, choices=(1, 2), default=1,
                        help="2: two models behind the gateways, each on its own P and D")
    parser.add_argument("--pin-budget", help="the gateways' --decode-pin-budget (a small one makes them evict)")
    parser.add_argument("--redis", choices=("single", "cluster"), default="single",
                        help="cluster: the store a Redis Cluster (three masters, a replica each)")
    parser.add_argument("--clients", type=int, help="concurrent clients (default: 150 quick, 300 else)")
    args = parser.parse_args()
    GATEWAY_FLAGS.extend(["--decode-pin-budget", args.pin_budget] if args.pin_budget else [])
    random.seed(args.seed)
    size = dict(clients=150, turns=4, fault_period=8.0, replicas=3) if args.quick else \
        dict(clients=300, turns=6, fault_period=20.0, replicas=3)
    size["clients"] = args.clients or size["clients"]
    t = asyncio.run(run(**size, kv_events=args.kv_events, models=args.models, cluster=args.redis == "cluster"))
    reuse_rate = t.reused / t.later_turns if t.later_turns else 0.0
    print(f"later turns: {t.later_turns} answered of {t.later_attempts}; {t.reused} of them reused D's KV")
    for reason, count in t.fallbacks.most_common():
        print(f"fallback {reason}: {count} ({count / max(t.later_turns, 1):.0%} of later turns)")
    if t.cluster:
        print(t.cluster)
    stale = sum(t.double_reads[k] for k in STALE_READS)
    print(f"chaos: turns={t.turns} corrupt={t.corrupt} stale_reads={stale} hung={t.hung} leaked_pins={t.leaked_pins} "
          f"bad_input_5xx={t.bad_input_5xx} non_openai_errors={t.non_openai_errors} reuse_rate={reuse_rate:.2f}")


if __name__ == "__main__":
    main()
