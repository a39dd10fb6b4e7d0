"""Versioned migrations of the Redis store, applied in order, each at most once.

A migration is a file `migrations/NNNN_name.py` holding `VERSION: int` (= NNNN), `DESCRIPTION: str` and
`async def up(redis) -> None`, where `redis` is a redis-py asyncio client. `up` must be idempotent: a run
that dies between `up` and its record re-runs it. Applied versions are recorded in the hash
`pdgw:migrations` (version → JSON with description and time); `pdgw:schema_version` holds the highest.
A lock serializes replicas that migrate at once.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .redis_store import client_from_url

MIGRATIONS_KEY = "pdgw:migrations"
SCHEMA_VERSION_KEY = "pdgw:schema_version"
LOCK_KEY = "pdgw:migrations:lock"
DEFAULT_DIRECTORY = Path(__file__).resolve().parents[2] / "migrations"
LOCK_TTL_S = 600.0  # a crashed migrator's lock lapses after this
LOCK_WAIT_S = 60.0
OP_TIMEOUT_S = 60.0  # migrations may run long commands; turns never wait on this client

_FILE_RE = re.compile(r"(\d{4})_\w+\.py")


@dataclass(frozen=True)
class Migration:
    version: int
    description: str
    up: Callable[[Any], Awaitable[None]]
    path: Path


def load_migrations(directory: Path) -> list[Migration]:
    """Every `NNNN_name.py` in `directory`, checked and sorted by version."""
    if not directory.is_dir():
        raise FileNotFoundError(f"no migrations directory at {directory}")
    migrations: dict[int, Migration] = {}
    for path in sorted(directory.iterdir()):
        match = _FILE_RE.fullmatch(path.name)
        if match is None:
            continue
        spec = importlib.util.spec_from_file_location(f"pdgw_migration_{path.stem}", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        version, description, up = (getattr(module, name, None) for name in ("VERSION", "DESCRIPTION", "up"))
        if version != int(match.group(1)) or not isinstance(version, int):
            raise ValueError(f"{path.name}: VERSION must be {int(match.group(1))}, got {version!r}")
        if not isinstance(description, str) or not inspect.iscoroutinefunction(up):
            raise ValueError(f"{path.name}: needs DESCRIPTION: str and async def up(redis)")
        if version in migrations:
            raise ValueError(f"{path.name}: version {version} also in {migrations[version].path.name}")
        migrations[version] = Migration(version, description, up, path)
    return [migrations[v] for v in sorted(migrations)]


async def apply_migrations(redis_url: str, directory: Path | None = None) -> list[int]:
    """Apply the migrations not yet recorded in the store at `redis_url`; return their versions in order."""
    migrations = load_migrations(directory or DEFAULT_DIRECTORY)
    client = client_from_url(redis_url, connect_timeout_s=5.0, op_timeout_s=OP_TIMEOUT_S)
    applied: list[int] = []
    try:
        async with client.lock(LOCK_KEY, timeout=LOCK_TTL_S, blocking_timeout=LOCK_WAIT_S):
            recorded = {int(v) for v in await client.hkeys(MIGRATIONS_KEY)}
            for migration in migrations:
                if migration.version in recorded:
                    continue
                await migration.up(client)
                entry = json.dumps({"description": migration.description, "applied_at": time.time()})
                await client.hset(MIGRATIONS_KEY, str(migration.version), entry)
                recorded.add(migration.version)
                applied.append(migration.version)
                await client.set(SCHEMA_VERSION_KEY, max(recorded))
            # Single-key commands, no MULTI (Cluster-friendly): rewriting the version on every run repairs
            # one that died between recording a migration and writing it.
            if recorded:
                await client.set(SCHEMA_VERSION_KEY, max(recorded))
    finally:
        await client.aclose()
    return applied


async def schema_version(redis_url: str) -> int:
    """The store's recorded schema version; 0 before any migration."""
    client = client_from_url(redis_url)
    try:
        return int(await client.get(SCHEMA_VERSION_KEY) or 0)
    finally:
        await client.aclose()
