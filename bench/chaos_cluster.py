"""The chaos soak on Redis Cluster (`bench/chaos.py --redis cluster`, issue 40): the fleet's store is a cluster of
three masters, each with one replica (tests/redis_cluster.py), the gateways on `redis+cluster://`. Two faults
take the place of the single Redis' restart:

- a gateway replica killed (SIGKILL) while it streams turns, restarted on its port 2 s later: the turns it was
  serving are cut without an error event (a dead process sends none); the client counts each as `interrupted`
  and sends it again to another replica, as a load balancer would;
- the Redis master that the gateways were given as their seed crashed (SIGKILL), its replica elected after
  `cluster-node-timeout` (1 s here), then the old master restarted, where it rejoins as a replica.

Then, beyond the soak's own checks: the share of later turns that reused D's KV in the window after each fault
(on the replicas that survived it too), and every D's pin-budget shares (`/admin/engines` `pin_share`, each
replica's D budget over the replicas alive, turns/state/replicas.py) summing to D's budget: timed from the
restarted replica's start until they do, and once more at the end.
"""

from __future__ import annotations

import asyncio
import signal
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import aiohttp

if TYPE_CHECKING:
    from bench.chaos import Fleet, Tally

ADMIN_KEY = "chaos-admin"          # the gateways' --admin-key, to read /admin/engines
SHARES_SETTLE_S = 20.0             # a gone replica drops out after 3 beats of 2 s: settled well within this
MIN_WINDOW_TURNS = 10              # fewer later turns after a fault than this: too few to say reuse continued


@dataclass
class ClusterFindings:
    failover_s: float | None = None        # the master's crash until its replica served its slots
    replica_down_s: float | None = None    # the replica's kill until it answered /health again
    shares_settled_s: float | None = None  # its restart until every D's shares summed to D's budget
    shares_end: str = "unread"             # "ok", or what was wrong at the end
    windows: dict[str, tuple[int, int, int, int]] = field(default_factory=dict)  # fault: later, reused, survivors'
    trace: list[str] = field(default_factory=list)   # what the shares said while they settled

    def reuse_after(self, fault: str, survivors: bool = False) -> float | None:
        later, reused, survivor_later, survivor_reused = self.windows.get(fault, (0, 0, 0, 0))
        n, r = (survivor_later, survivor_reused) if survivors else (later, reused)
        return r / n if n >= MIN_WINDOW_TURNS else None

    def line(self, interrupted: int) -> str:
        def num(value: float | None) -> str:
            return "none" if value is None else f"{value:.2f}"
        return (f"cluster: interrupted={interrupted} replica_down_s={num(self.replica_down_s)} "
                f"failover_s={num(self.failover_s)} reuse_after_replica_kill={num(self.reuse_after(KILL))} "
                f"survivors_reuse_after_replica_kill={num(self.reuse_after(KILL, survivors=True))} "
                f"reuse_after_failover={num(self.reuse_after(FAILOVER))} "
                f"shares_settled_s={num(self.shares_settled_s)} shares_end={self.shares_end}")


KILL = "kill gateway replica 0 mid-stream, restart it 2 s later"
FAILOVER = "crash the seed Redis master, its replica takes over"


def faults() -> list[tuple[str, object]]:
    return [(KILL, lambda fleet, period: kill_replica(fleet, 0, down_s=2)),
            (FAILOVER, lambda fleet, period: fail_over(fleet))]


def cut(fleet: Fleet, url: str, began: float) -> bool:
    """A turn's transport error is the replica's kill: it died after the turn began, or is down now."""
    return fleet.killed.get(url, float("-inf")) >= began or url in fleet.down


async def kill_replica(fleet: Fleet, index: int, down_s: float) -> None:
    old = fleet.gateways[index]
    fleet.down.add(old.url)
    fleet.killed[old.url] = killed = time.monotonic()
    old.stop(signal.SIGKILL)
    await asyncio.sleep(down_s)
    fleet.gateways[index] = await asyncio.to_thread(fleet.gateway, old.port)
    fleet.down.discard(old.url)
    restarted = time.monotonic()
    fleet.findings.replica_down_s = restarted - killed
    if await shares_settle(fleet, SHARES_SETTLE_S):
        fleet.findings.shares_settled_s = time.monotonic() - restarted


async def fail_over(fleet: Fleet) -> None:
    seed = fleet.redis.nodes[0]                 # the node the gateways' URL names
    fleet.findings.failover_s = await asyncio.to_thread(fleet.redis.fail_over, seed)
    await asyncio.to_thread(fleet.redis.rejoin, seed)


async def shares(fleet: Fleet) -> str:
    """"ok" when, for every D, each replica counts every replica alive and their shares sum to D's budget (to
    the block: each share is rounded down); else what is wrong."""
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    seen: dict[str, list[tuple[int, int]]] = {}
    budgets: dict[str, int] = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
        for gateway in fleet.gateways:
            async with http.get(gateway.url + "/admin/engines", headers=headers) as resp:
                resp.raise_for_status()
                engines = (await resp.json())["engines"]
            for e in engines:
                if e["role"] == "decode" and e.get("num_gpu_blocks"):
                    budgets[e["url"]] = int(e["num_gpu_blocks"] * fleet.pin_budget)
                    share = e.get("pin_share") or {"replicas": 0, "budget_blocks": 0}
                    seen.setdefault(e["url"], []).append((share["replicas"], share["budget_blocks"] or 0))
    replicas = len(fleet.gateways)
    for d, budget in budgets.items():
        counts, total = {r for r, _ in seen[d]}, sum(b for _, b in seen[d])
        if counts != {replicas} or not budget - replicas < total <= budget:
            return f"{d}:replicas={sorted(counts)},shares={total},budget={budget}"
    return "ok" if budgets else "no_budget"


async def shares_settle(fleet: Fleet, timeout_s: float) -> bool:
    began = time.monotonic()
    deadline, last = began + timeout_s, ""
    while (verdict := await _shares_or_error(fleet)) != "ok":
        if verdict != last:
            fleet.findings.trace.append(f"+{time.monotonic() - began:.2f}s {verdict}")
            last = verdict
        if time.monotonic() > deadline:
            fleet.findings.shares_end = verdict
            return False
        await asyncio.sleep(0.25)
    return True


async def _shares_or_error(fleet: Fleet) -> str:
    try:
        return await shares(fleet)
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return f"unreadable:{type(exc).__name__}"


def reuse_windows(fleet: Fleet, tally: Tally, period: float) -> None:
    """For each cluster fault, the later turns that ended within `period` after it ended: how many, how many
    reused D's KV, and the same on the replicas other than the one killed."""
    for name, _, ended in tally.fault_times:
        if name not in (KILL, FAILOVER):
            continue
        window = [(reused, url) for at, reused, url in tally.later if ended <= at < ended + period]
        killed = set(fleet.killed)
        survivors = [reused for reused, url in window if url not in killed]
        fleet.findings.windows[name] = (len(window), sum(r for r, _ in window), len(survivors), sum(survivors))


async def check(fleet: Fleet, tally: Tally, period: float) -> None:
    """The end of a cluster run: reuse after each fault, and the shares once more (the last fault may have moved
    them for a beat: given the same time to settle)."""
    reuse_windows(fleet, tally, period)
    if await shares_settle(fleet, SHARES_SETTLE_S):
        fleet.findings.shares_end = "ok"
