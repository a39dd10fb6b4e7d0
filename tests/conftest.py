"""Session-wide fixtures: one real redis-server for every test that needs Redis."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.redis_server import RedisServer


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="session")
def redis_url(redis_server: RedisServer) -> str:
    return redis_server.url
