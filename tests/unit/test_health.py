"""Active health checks against a real HTTP server on loopback: a busy engine that answers /health late stays
in rotation (overload must not become 503s for everyone); one that stops answering, or refuses, goes out."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web

from gateway.engines import health
from gateway.engines.client import EngineClient
from gateway.engines.health import HealthChecker
from gateway.engines.pool import EnginePool
from gateway.telemetry import Metrics


async def serve(delay: dict[str, float]) -> tuple[web.AppRunner, str]:
    async def answer(_: web.Request) -> web.Response:
        await asyncio.sleep(delay["s"])
        return web.Response(text="")

    app = web.Application()
    app.router.add_get("/health", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


@pytest.fixture(autouse=True)
def quick(monkeypatch):
    monkeypatch.setattr(health, "PROBE_TIMEOUT_S", 0.05)
    monkeypatch.setattr(health, "SLOW_GRACE_S", 0.6, raising=False)


async def checks(checker: HealthChecker, n: int, pause: float = 0.05) -> None:
    for _ in range(n):
        await checker.check_all()
        await asyncio.sleep(pause)


def test_a_slow_engine_stays_healthy_a_silent_one_goes_down():
    async def scenario() -> tuple[bool, bool]:
        delay = {"s": 0.0}
        runner, url = await serve(delay)
        pool = EnginePool("prefill", [url])
        async with aiohttp.ClientSession() as session:
            checker = HealthChecker(EngineClient(session), [pool], Metrics(), interval_s=0.05)
            await checks(checker, 2)
            delay["s"] = 0.2                     # busy: answers, but after the probe's timeout
            await checks(checker, 4)             # ~0.4 s of slow answers: within the grace
            slow_but_healthy = pool.engines[url].healthy
            delay["s"] = 1.5                     # hung: no answer within the grace
            await checks(checker, 12)
            hung_marked_down = not pool.engines[url].healthy
        await runner.cleanup()
        return slow_but_healthy, hung_marked_down

    assert asyncio.run(scenario()) == (True, True)


def test_a_refusing_engine_goes_down_after_two_misses():
    async def scenario() -> bool:
        runner, url = await serve({"s": 0.0})
        pool = EnginePool("decode", [url])
        async with aiohttp.ClientSession() as session:
            checker = HealthChecker(EngineClient(session), [pool], Metrics(), interval_s=0.05)
            await checks(checker, 1)
            await runner.cleanup()               # the port now refuses connections
            await checks(checker, 2, pause=0)
            return pool.engines[url].healthy

    assert asyncio.run(scenario()) is False


def test_an_engine_coming_back_healthy_is_handed_to_the_readmission_hook_once():
    """What was proven about an engine (pinned prompt ids) is re-checked when it returns: it may be another one."""
    async def scenario() -> tuple[list[str], str]:
        runner, url = await serve({"s": 0.0})
        pool = EnginePool("prefill", [url])
        pool.engines[url].healthy = False                # down, as after an outage (or just added)
        back: list[str] = []
        async with aiohttp.ClientSession() as session:
            checker = HealthChecker(EngineClient(session), [pool], Metrics(), interval_s=0.05)
            checker.on_readmit.append(lambda engine: back.append(engine.url))
            await checks(checker, 3)
        await runner.cleanup()
        return back, url
    back, url = asyncio.run(scenario())
    assert back == [url]


def test_a_ds_kv_capacity_is_read_once_it_reports_one():
    page = {"blocks": "None"}                   # vLLM says "None" while it still profiles its memory

    async def scenario() -> list[object]:
        async def metrics(_: web.Request) -> web.Response:
            return web.Response(text=f'vllm:cache_config_info{{block_size="16",num_gpu_blocks="{page["blocks"]}"}} 1.0\n')

        async def ok(_: web.Request) -> web.Response:
            return web.Response(text="")

        app = web.Application()
        app.router.add_get("/health", ok)
        app.router.add_get("/metrics", metrics)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        pool = EnginePool("decode", [url])
        seen = []
        async with aiohttp.ClientSession() as session:
            checker = HealthChecker(EngineClient(session), [pool], Metrics(), interval_s=0.05)
            await checker.check_all()
            seen.append(pool.engines[url].facts.num_gpu_blocks)
            page["blocks"] = "1234"
            await checker.check_all()
            seen.append(pool.engines[url].facts.num_gpu_blocks)
        await runner.cleanup()
        return seen

    assert asyncio.run(scenario()) == [None, 1234]
