"""Releasing an unused D handle through P (turns/legs/release.py): a release no P could take is tried again
until a P comes back; one a P answered (even with an error) is never sent twice; shutting down stops retries."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from gateway.config import Settings
from gateway.engines import kv
from gateway.engines.pool import EnginePool
from gateway.errors import EngineConnectError, EngineFailedError, EngineUnavailableError
from gateway.telemetry import Metrics
from gateway.turns.legs import release
from gateway.turns.legs.calls import EngineCalls
from gateway.turns.legs.release import HandleReleaser

P = "http://p0"
HANDLE = kv.Handle({"do_remote_decode": True, "remote_engine_id": "d0", "remote_block_ids": [[1, 2]],
                    "remote_request_id": "r1", "remote_host": "h", "remote_port": 1, "remote_num_tokens": 31})


class FlakyP:
    """P refuses connections `down` times, then answers (or fails with `error`)."""

    def __init__(self, down: int, error: Exception | None = None) -> None:
        self.down, self.error, self.calls = down, error, 0

    async def post_json(self, url: str, path: str, body: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        self.calls += 1
        assert body["kv_transfer_params"]["remote_num_tokens"] == 0
        if self.calls <= self.down:
            raise EngineConnectError("connection refused")
        if self.error is not None:
            raise self.error
        return {"choices": [{}]}


def releaser(p: FlakyP) -> HandleReleaser:
    metrics = Metrics()
    pool = EnginePool("prefill", Settings(prefill=[P], decode=["http://d0"]).prefill)
    return HandleReleaser(p, pool, EngineCalls(metrics), metrics, "m")


@pytest.fixture(autouse=True)
def fast_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(release, "RETRY_FIRST_S", 0.01)
    monkeypatch.setattr(release, "RETRY_MAX_S", 0.02)


def released(p: FlakyP) -> int:
    """One release, run until it is sent or given up: how many times P was asked."""
    async def go() -> None:
        r = releaser(p)
        r.release(HANDLE, "unused")
        for _ in range(200):
            if not r._tasks:
                return
            await asyncio.sleep(0.01)
    asyncio.run(go())
    return p.calls


def test_a_release_while_p_is_down_is_sent_once_p_is_back():
    assert released(FlakyP(down=3)) == 4


@pytest.mark.parametrize("error", [EngineFailedError("P failed"), EngineUnavailableError("engine went away")])
def test_a_release_p_took_is_not_sent_again(error):
    """P answered with an error, or went away with the request: it may have notified D already."""
    assert released(FlakyP(down=0, error=error)) == 1


def test_a_release_while_no_p_is_up_is_sent_once_one_is():
    p = FlakyP(down=0)
    r = releaser(p)
    r.prefill.get(P).healthy = False

    async def go() -> None:
        r.release(HANDLE, "unused")
        await asyncio.sleep(0.05)
        assert p.calls == 0                            # none to pick: nothing sent, tried again
        r.prefill.get(P).healthy = True
        for _ in range(200):
            if not r._tasks:
                return
            await asyncio.sleep(0.01)
    asyncio.run(go())
    assert p.calls == 1


def test_retries_stop_at_the_limit_and_at_shutdown(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(release, "RELEASE_RETRY_S", 0.1)
    assert 2 <= released(FlakyP(down=10**6)) < 20

    monkeypatch.setattr(release, "RELEASE_RETRY_S", 60.0)
    monkeypatch.setattr(release, "RETRY_FIRST_S", 30.0)
    q = FlakyP(down=10**6)

    async def shutdown() -> None:
        r = releaser(q)
        r.release(HANDLE, "unused")
        await asyncio.sleep(0.05)
        await asyncio.wait_for(r.drain(), 2)           # the 30 s pause ends at once
    asyncio.run(shutdown())
    assert q.calls == 1
