"""Redis deployments behind one URL: a single server, Sentinel (failover) or Cluster.

    redis://[user:pass@]host:port/db, rediss://..., unix:///path.sock     one server
    redis+sentinel://[:pass@]host:port[,host:port...]/service[/db]         Sentinel: the current master
    redis+cluster://[user:pass@]host:port                                  Cluster: any seed node

Every store operation touches one key (its Lua scripts too), so all three behave alike; after a failover the
Sentinel client asks the sentinels for the new master on its next connection.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import NoBackoff

try:
    from redis.driver_info import DriverInfo
except ImportError:         # an older redis-py, which reads its own version once, at import
    DriverInfo = None

SCHEMES = ("redis", "rediss", "unix", "redis+sentinel", "redis+cluster")
DEFAULT_SENTINEL_PORT = 26379


def client(url: str, *, connect_timeout_s: float,
           op_timeout_s: float | None) -> aioredis.Redis | RedisCluster:
    parts = urlsplit(url)
    # Never retried: a retried begin_turn whose first reply was lost would claim a handle twice.
    common: dict[str, Any] = {"socket_connect_timeout": connect_timeout_s, "socket_timeout": op_timeout_s,
                              "retry": Retry(NoBackoff(), 0), "client_name": "pd-gateway"}
    if DriverInfo is not None:
        # One for every connection: without it each new connection builds its own and reads redis-py's version
        # from the installed metadata (0.6 ms of the loop's time on the 2-core machine, more on a long sys.path):
        # a burst of new turns paid it once per connection the pool grew by.
        common["driver_info"] = DriverInfo()
    if parts.scheme == "redis+sentinel":
        return _sentinel_master(parts.netloc, parts.path, common)
    if parts.scheme == "redis+cluster":
        common.pop("client_name")
        return RedisCluster.from_url(urlunsplit(("redis", *parts[1:])), **common)
    if parts.scheme not in SCHEMES:
        raise ValueError(f"unsupported store URL scheme {parts.scheme!r}; use one of {SCHEMES}")
    return aioredis.from_url(url, **common)


def _sentinel_master(netloc: str, path: str, common: dict[str, Any]) -> aioredis.Redis:
    userinfo, _, hosts = netloc.rpartition("@")
    password = unquote(userinfo.partition(":")[2]) or None
    nodes = [_host_port(h) for h in hosts.split(",") if h]
    service, _, db = path.strip("/").partition("/")
    if not nodes or not service:
        raise ValueError("redis+sentinel URLs name sentinels and a service: redis+sentinel://h:p[,h:p]/service")
    timeouts = {k: common[k] for k in ("socket_connect_timeout", "socket_timeout")}
    sentinel = Sentinel(nodes, sentinel_kwargs=timeouts, password=password, db=int(db or 0), **common)
    return sentinel.master_for(service)


def _host_port(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":") if ":" in text else (text, "", "")
    return host, int(port or DEFAULT_SENTINEL_PORT)
