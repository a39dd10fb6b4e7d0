"""Engines found through DNS (issue 40). A pool entry `dns://NAME:PORT` is a name to follow, such as a Kubernetes
headless Service's (`pdgw-decode.NS.svc.cluster.local`), which answers one A record per ready pod. Each name is
resolved at start and again every `discovery_interval_s`; the pool then changes through the registry, the way a
SIGHUP reload changes it: an address that appears joins as `http://IP:PORT` (probed before it is picked), one that
is gone leaves (its turns in flight finish; a conversation whose D left falls back, `decode_unavailable`).

What an answer means:
- A records: the engines now.
- NXDOMAIN, or the name without A records: an answer that there are none (CoreDNS gives it from the Service's
  endpoints: scaled to zero, or no pod ready). The name's engines leave.
- No answer (a timeout, SERVFAIL, no nameserver reachable): nothing is known, so the last set is kept. A DNS
  hiccup must not empty a pool; an engine that did go meanwhile is found out by the health loop.
Each name's log line is written when what it resolves to, or why it fails, changes; not every interval.

Only A records are asked for (IPv4 pods). An engine's name in /metrics is ROLE-IP (`decode-10.0.3.7`, the model's
prefix before it where several are served) unless `--engine-names` names its `http://IP:PORT`: the same for the
pod's life and for a pod that leaves and comes back, where a join order would give a new series each time.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import dns.asyncresolver
import dns.exception
import dns.name
import dns.resolver

from gateway.config import nameserver
from gateway.engines.engine import Role
from gateway.engines.pool import EnginePool
from gateway.engines.registry import EngineRegistry

log = logging.getLogger("gateway.discovery")

SCHEME = "dns://"
RESOLVE_TIMEOUT_S = 2.0       # one look at a name; a cluster's DNS answers in milliseconds
ROLES: tuple[Role, ...] = ("prefill", "decode")


class DnsResolver:
    """A records through dnspython: the system's resolver (resolv.conf: its search domains, as a pod's other
    clients use them), or one nameserver given by address (`--discovery-nameserver`, tests)."""

    def __init__(self, server: str | None = None, timeout_s: float = RESOLVE_TIMEOUT_S) -> None:
        self._server, self._timeout_s = server, timeout_s
        self._resolver: dns.asyncresolver.Resolver | None = None

    def _made(self) -> dns.asyncresolver.Resolver:
        """Built at first use: a gateway without dns:// entries never reads resolv.conf."""
        if self._resolver is None:
            if self._server is None:
                resolver = dns.asyncresolver.Resolver()
            else:
                host, port = nameserver(self._server)
                resolver = dns.asyncresolver.Resolver(configure=False)
                resolver.nameservers, resolver.port = [host], port
                resolver.domain, resolver.search = dns.name.root, []     # the name as given
            resolver.timeout = resolver.lifetime = self._timeout_s
            self._resolver = resolver
        return self._resolver

    async def addresses(self, host: str) -> frozenset[str] | str:
        """The name's IPv4 addresses (empty: it has none), or why there is no answer."""
        try:
            answer = await self._made().resolve(host, "A", search=True)
        except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
            return frozenset()
        except dns.resolver.LifetimeTimeout:
            return f"no answer within {self._timeout_s:g} s"
        except dns.exception.DNSException as exc:      # SERVFAIL from every nameserver, no resolv.conf, ...
            return str(exc) or type(exc).__name__
        return frozenset(record.address for record in answer)


@dataclass
class FollowedName:
    """One dns:// entry: what it resolved to last and what was last said of it."""
    entry: str
    host: str
    port: int
    addresses: frozenset[str] = frozenset()
    said: str | None = None             # the last state logged: "ok" or why it fails

    @classmethod
    def of(cls, entry: str) -> FollowedName:
        parts = urlsplit(entry)
        return cls(entry, parts.hostname or "", parts.port or 0)

    @property
    def urls(self) -> list[str]:
        return [f"http://{address}:{self.port}" for address in sorted(self.addresses)]

    def take(self, answer: frozenset[str] | str, quiet: bool = False) -> None:
        """A look's result: addresses replace the last; a failure keeps them. Logged where something changed."""
        state = "ok" if isinstance(answer, frozenset) else answer
        if not quiet and (state != self.said or answer != self.addresses and state == "ok"):
            self._say(answer)
        self.said = state
        if isinstance(answer, frozenset):
            self.addresses = answer

    def _say(self, answer: frozenset[str] | str) -> None:
        if isinstance(answer, str):
            log.warning("%s: %s; keeping its %d engine(s) of the last answer", self.entry, answer,
                        len(self.addresses))
        elif answer:
            log.info("%s: %s", self.entry, ", ".join(sorted(answer)))
        else:
            log.warning("%s: no such name or no A record (no pod ready?): none of its engines stay", self.entry)


@dataclass
class EngineDiscovery:
    """A model's pool entries as they resolve now: fixed URLs as given, each dns:// entry its last addresses."""
    resolver: DnsResolver
    interval_s: float
    entries: dict[Role, list[str]] = field(default_factory=lambda: {role: [] for role in ROLES})
    followed: dict[str, FollowedName] = field(default_factory=dict)
    quiet: bool = False                 # serve's pre-flight look: the gateway's own look, just after, logs
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def wanted(self, role: Role) -> list[str]:
        """The role's engine URLs: the settings' entries, each dns:// one replaced by what it resolved to."""
        urls: list[str] = []
        for entry in self.entries[role]:
            followed = self.followed.get(entry)
            urls += followed.urls if followed else [entry.rstrip("/")]
        return list(dict.fromkeys(urls))

    def found_under(self, url: str) -> list[str]:
        """The dns:// entries whose last answer holds the engine at `url` (their --kv-events entries cover it)."""
        return [followed.entry for followed in self.followed.values() if url in followed.urls]

    async def follow(self, prefill: list[str], decode: list[str]) -> None:
        """The settings' entries (at start, on a reload); a name new to it is resolved at once."""
        self.entries = {"prefill": list(prefill), "decode": list(decode)}
        dns_entries = [e for e in (*prefill, *decode) if e.startswith(SCHEME)]
        known = self.followed
        self.followed = {entry: known.get(entry) or FollowedName.of(entry) for entry in dns_entries}
        await self._look([self.followed[e] for e in dns_entries if e not in known])

    def pool(self, role: Role, names: dict[str, str], prefix: str = "") -> EnginePool:
        """The role's pool at start, its discovered engines named by their address."""
        pool = EnginePool(role, [], names, prefix)
        self._name(pool)
        for url in self.wanted(role):
            pool.add(url)
        return pool

    async def reload(self, registry: EngineRegistry, prefill: list[str], decode: list[str]) -> dict[str, list[str]]:
        """A reload's entries, resolved and made the pools (engines it no longer names leave)."""
        async with self._lock:
            await self.follow(prefill, decode)
            for pool in registry.pools.values():
                self._name(pool)
            return await registry.sync(self.wanted("prefill"), self.wanted("decode"))

    async def run(self, registry: EngineRegistry) -> None:
        """Every interval: each name looked at again, the engines that appeared joining, those gone leaving."""
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                async with self._lock:
                    before = {role: set(self.wanted(role)) for role in ROLES}
                    await self._look(list(self.followed.values()))
                    await self._apply(registry, before)
            except Exception:      # the loop must outlive one bad round, or the pools would freeze unnoticed
                log.exception("engine discovery: this round failed; the next one runs in %g s", self.interval_s)

    async def _look(self, names: list[FollowedName]) -> None:
        answers = await asyncio.gather(*(self.resolver.addresses(n.host) for n in names))
        for followed, answer in zip(names, answers, strict=True):
            followed.take(answer, self.quiet)

    async def _apply(self, registry: EngineRegistry, before: dict[Role, set[str]]) -> None:
        """Only what the names changed: an engine added by the admin API stays."""
        for role in ROLES:
            pool, now = registry.pools[role], set(self.wanted(role))
            for url in sorted(before[role] - now):
                registry.remove(role, url)
                if pool.names.get(url) == _found_name(pool, url):
                    del pool.names[url]
            self._name(pool)
            for url in sorted(now - before[role]):
                await registry.add(role, url)

    def _name(self, pool: EnginePool) -> None:
        """The pool's discovered engines named by their address, unless --engine-names names them."""
        for followed in self.followed.values():
            if followed.entry in self.entries[pool.role]:
                for url in followed.urls:
                    pool.names.setdefault(url, _found_name(pool, url))


def _found_name(pool: EnginePool, url: str) -> str:
    return f"{pool.prefix}{pool.role}-{urlsplit(url).hostname}"


async def resolved(prefill: list[str], decode: list[str], server: str | None,
                   quiet: bool = False) -> tuple[list[str], list[str]]:
    """The engine URLs the entries stand for now, once (`pd-gateway check`, serve's pre-flight)."""
    discovery = EngineDiscovery(DnsResolver(server), 0.0, quiet=quiet)
    await discovery.follow(prefill, decode)
    return discovery.wanted("prefill"), discovery.wanted("decode")
