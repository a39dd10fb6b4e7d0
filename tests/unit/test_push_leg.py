"""Push mode's pair of legs (turns/run/push_leg.py) and its retries, without processes: a scripted client that plays
both engines of docs/protocol.md §8 (P's answer WRITEs for its X-Request-Id; D's leg waits for that WRITE), real
pools, the embedded store. One test per way a pair can go."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from typing import Any

import pytest

from gateway.config import Settings
from gateway.engines import kv
from gateway.engines.pool import EnginePool
from gateway.errors import EngineConnectError, EngineFailedError, EngineTimeoutError, GatewayError
from gateway.store import ConversationKey, MemoryConversationStore
from gateway.telemetry import Metrics
from gateway.turns.intake.request import TurnRequest
from gateway.turns.legs.calls import EngineCalls
from gateway.turns.legs.release import HandleReleaser
from gateway.turns.runner import TurnRunner
from gateway.turns.state.state import ConversationState

BS = 4
PROMPT = list(range(100, 123))            # 23 tokens
OUTPUT = [5, 6]
KEY = ConversationKey("t", "s")
REFUSED, FAILED = EngineConnectError("refused"), EngineFailedError("engine answered HTTP 500")


class PushWorld:
    """Both engines, scripted. P's answer is its WRITE for the leg's X-Request-Id (unless it `never_writes`);
    D's push leg answers once the WRITE for its id came. Faults are consumed one per leg, in order:
    None (normal), an error (raised at once), or ("after_write", error) for D."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, dict[str, Any]]] = []    # (url, X-Request-Id, body)
        self.written: defaultdict[str, asyncio.Event] = defaultdict(asyncio.Event)
        self.p_faults: list[Any] = []
        self.d_faults: list[Any] = []
        self.p_seconds = 0.0
        self.p_delays: list[float] = []                          # per P leg, in order, before p_seconds
        self.never_writes = False
        self.p_engine_id = "p-engine"
        self.renamed: dict[str, str] = {}                        # P restarted with a new engine id
        self.cancelled: list[str] = []                           # legs whose caller gave up (url)
        self.stream = False

    async def post_json(self, url: str, path: str, body: dict[str, Any], *, timeout_s: float,
                        headers: dict[str, str] | None = None, **_: Any) -> dict[str, Any]:
        rid = (headers or {}).get("X-Request-Id", "")
        self.calls.append((url, rid, body))
        try:
            async with asyncio.timeout(timeout_s):
                return await (self._prefill(url, rid) if "://p" in url else self._decode(rid, body))
        except TimeoutError:
            raise EngineTimeoutError("engine did not answer in time") from None
        except asyncio.CancelledError:
            self.cancelled.append(url)
            raise

    async def open_stream(self, url: str, path: str, body: dict[str, Any], *, first_byte_timeout_s: float,
                          headers: dict[str, str] | None = None, **_: Any) -> FakeStream:
        rid = (headers or {}).get("X-Request-Id", "")
        self.calls.append((url, rid, body))
        await asyncio.sleep(0)                   # headers at once: D's first token comes after the WRITE
        return FakeStream(self, url, rid)

    async def _prefill(self, url: str, rid: str) -> dict[str, Any]:
        await asyncio.sleep(self.p_delays.pop(0) if self.p_delays else self.p_seconds)
        fault = self.p_faults.pop(0) if self.p_faults else None
        if isinstance(fault, GatewayError):
            raise fault
        if not self.never_writes:
            self.written[rid].set()
        handle = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1]],
                  "remote_engine_id": self.renamed.get(url, self.p_engine_id), "remote_host": url[7:], "remote_port": 5600,
                  "tp_size": 1, "pp_size": 1, "remote_num_tokens": len(PROMPT), "transfer_mode": "push"}
        return {"choices": [{"message": {"content": "x"}, "finish_reason": "length"}],
                "kv_transfer_params": handle}

    async def _decode(self, rid: str, body: dict[str, Any]) -> dict[str, Any]:
        fault = self.d_faults.pop(0) if self.d_faults else None
        if isinstance(fault, GatewayError):
            raise fault
        params = body.get("kv_transfer_params") or {}
        if params.get("do_remote_prefill"):
            p_url = "http://" + params["remote_host"]
            if params["remote_engine_id"] != self.renamed.get(p_url, self.p_engine_id):
                raise FAILED                      # D's handshake with P refused: a failed load
            await self.written[rid].wait()
        if isinstance(fault, tuple):
            raise fault[1]
        return {"choices": [{"message": {"content": "ok"}, "finish_reason": "stop", "token_ids": OUTPUT}],
                "prompt_token_ids": PROMPT, "kv_transfer_params": None}

    def legs(self) -> list[tuple[str, str]]:
        """(engine, X-Request-Id) of each leg, in the order sent."""
        return [(url, rid) for url, rid, _ in self.calls]


class FakeStream:
    def __init__(self, world: PushWorld, url: str, rid: str) -> None:
        self.world, self.url, self.rid, self.events = world, url, rid, [
            b'{"choices":[{"delta":{"role":"assistant","content":""}}],"prompt_token_ids":null}',
            b'{"choices":[{"delta":{"content":"ok"},"token_ids":[5,6],"finish_reason":"stop"}]}', b"[DONE]"]
        self.closed = False

    async def first_events(self, timeout_s: float) -> list[bytes]:
        fault = self.world.d_faults.pop(0) if self.world.d_faults else None
        if fault is not None:       # an error event before any token: a failed load (the handshake with P)
            raise EngineFailedError("decode engine failed before its first token")
        try:
            async with asyncio.timeout(timeout_s):
                await self.world.written[self.rid].wait()
        except TimeoutError:
            raise EngineTimeoutError("decode engine sent no token in time") from None
        return self.events[:1]

    async def next_events(self) -> list[bytes] | None:
        if not self.events:
            return None
        events, self.events = self.events, []
        return events

    def close(self) -> None:
        self.closed = True


async def built(world: PushWorld, *, retries: int = 2, known: bool = True, local: int = 0,
                stream: bool = False) -> tuple[TurnRunner, TurnRequest, Metrics]:
    settings = Settings(prefill=["http://p0", "http://p1"], decode=["http://d0", "http://d1"], max_retries=retries,
                        prefill_affinity=False, local_prefill_max_tokens=local, kv_transfer_mode="push",
                        decode_first_byte_timeout_s=0.3, prefill_timeout_s=0.5)
    store, metrics = MemoryConversationStore(), Metrics()
    prefill, decode = EnginePool("prefill", settings.prefill), EnginePool("decode", settings.decode)
    for engine in prefill.engines.values():
        engine.facts.pinned_ids = True
        if known:                         # what the start-up pair learned (engines/transfer.py)
            engine.facts.push_target = kv.PushTarget(world.p_engine_id, engine.url[7:], 5600)
    calls = EngineCalls(metrics)
    releaser = HandleReleaser(world, prefill, calls, metrics, "m")  # type: ignore[arg-type]
    state = ConversationState(store=store, decode=decode, releaser=releaser, metrics=metrics, settings=settings,
                              block_size=BS, renderer=None)
    runner = TurnRunner(client=world, prefill=prefill, decode=decode, state=state, calls=calls,  # type: ignore[arg-type]
                        releaser=releaser, metrics=metrics, settings=settings, transfer_mode="push")
    return runner, request(PROMPT, stream), metrics


def request(prompt: list[int], stream: bool = False) -> TurnRequest:
    return TurnRequest(endpoint="/v1/chat/completions", body={"model": "m", "messages": []}, model="m",
                       prompt_ids=prompt, stream=stream, want_token_ids=False, include_usage=False,
                       request_id="r")


async def turn(world: PushWorld, **how: Any) -> tuple[Any, TurnRunner, Metrics]:
    runner, req, metrics = await built(world, **how)
    reply = await runner.run(req, KEY)
    if reply.stream is not None:
        reply.body = b"".join([chunk async for chunk in reply.stream])
    await runner.drain()
    return reply, runner, metrics


def p_legs(world: PushWorld) -> list[tuple[str, str]]:
    return [leg for leg in world.legs() if "://p" in leg[0]]


def d_legs(world: PushWorld) -> list[tuple[str, str]]:
    return [leg for leg in world.legs() if "://d" in leg[0]]


def aborts(metrics: Metrics, why: str) -> float:
    return metrics.push_decode_aborts.labels(why)._value.get()


# -- a pair that goes well ----------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
async def test_both_legs_go_out_together_with_one_fresh_id(stream):
    world = PushWorld()
    world.p_seconds = 0.05
    reply, _, _ = await turn(world, stream=stream)
    (p, p_rid), (d, d_rid) = p_legs(world)[0], d_legs(world)[0]
    assert len(world.calls) == 2 and p_rid == d_rid and p_rid.startswith("r-pair-") and p_rid != "r"
    assert world.calls[1][0] == d             # D went out before P answered (P took 50 ms)
    p_body, d_body = world.calls[0][2], world.calls[1][2]
    assert p_body["max_tokens"] == 1 and p_body["kv_transfer_params"]["do_remote_decode"] is True
    params = d_body["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_engine_id"] == "p-engine"
    assert params["remote_host"] == p[7:] and "remote_block_ids" not in params
    assert params["remote_request_id"] == f"chatcmpl-{p_rid}"   # P's id but for its random suffix (vLLM needs one)
    assert bytes(params["prompt_token_ids"]) == bytes(p_body["kv_transfer_params"]["prompt_token_ids"])
    assert (reply.headers["X-PD-Plan"], reply.headers["X-PD-Reason"]) == ("full", "first_turn")
    assert reply.headers["X-Request-Id"] == "r"                  # the client's own id is kept for it
    assert b"ok" in reply.body


async def test_every_pair_has_its_own_id():
    world = PushWorld()
    runner, req, _ = await built(world)
    await runner.run(req, None)
    await runner.run(request(PROMPT), None)
    ids = {rid for _, rid in world.legs()}
    assert len(ids) == 2


async def test_unknown_identity_sends_p_first_and_learns_it():
    world = PushWorld()
    reply, runner, _ = await turn(world, known=False)
    (p, rid), (_, d_rid) = world.legs()
    assert rid == d_rid and reply.headers["X-PD-Plan"] == "full"
    assert world.written[rid].is_set()                              # P had answered when D went out
    assert runner.prefill_pool.get(p).facts.push_target == kv.PushTarget("p-engine", p[7:], 5600)


# -- P's setbacks -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fault", [FAILED, "timeout"])
async def test_p_failing_is_redone_with_the_same_id_on_the_same_p(fault):
    world = PushWorld()
    world.p_faults = [FAILED] if fault is FAILED else []
    world.p_delays = [0.6] if fault == "timeout" else []          # over P's deadline (0.5 s) once
    reply, _, metrics = await turn(world)
    (p1, rid1), (p2, rid2) = p_legs(world)
    assert (p1, rid1) == (p2, rid2) and len(d_legs(world)) == 1 and d_legs(world)[0][1] == rid1
    assert reply.headers["X-PD-Reason"] == "first_turn" and aborts(metrics, "prefill_failed") == 0


async def test_p_failing_twice_redoes_the_pair_on_another_p():
    world = PushWorld()
    world.p_faults = [FAILED, FAILED]
    reply, _, metrics = await turn(world)
    (pa, rid_a), (pb, rid_b), (pc, rid_c) = p_legs(world)
    assert pa == pb and rid_a == rid_b and pc != pa and rid_c != rid_a
    assert [rid for _, rid in d_legs(world)] == [rid_a, rid_c]
    assert aborts(metrics, "prefill_failed") == 1       # the first D waited: it may keep its blocks (vLLM #46283)
    assert reply.headers["X-PD-Reason"] == "first_turn"


async def test_p_refused_waits_for_d_to_fail_then_another_p_and_the_same_d():
    world = PushWorld()
    world.p_faults = [REFUSED]
    original = world._decode

    async def decode(rid: str, body: dict[str, Any]) -> dict[str, Any]:
        if len(d_legs(world)) == 1:        # D cannot reach P either: its handshake fails, a failed load (§8.4)
            await asyncio.sleep(0.05)
            raise FAILED
        return await original(rid, body)
    world._decode = decode                                # type: ignore[method-assign]
    reply, _, metrics = await turn(world)
    (pa, rid_a), (pb, rid_b) = p_legs(world)
    (da, d_rid_a), (db, d_rid_b) = d_legs(world)
    assert pa != pb and rid_a != rid_b and da == db and (d_rid_a, d_rid_b) == (rid_a, rid_b)
    assert reply.headers["X-PD-Reason"] == "first_turn" and aborts(metrics, "prefill_failed") == 0


async def test_out_of_retries_the_error_reaches_the_client():
    world = PushWorld()
    world.p_faults = [FAILED] * 5
    with pytest.raises(EngineFailedError):
        await turn(world, retries=1)


# -- D's setbacks -------------------------------------------------------------------------------------------
async def test_d_refused_is_redone_with_the_same_id_on_another_d():
    world = PushWorld()
    world.d_faults = [REFUSED]
    reply, _, _ = await turn(world)
    (da, rid_a), (db, rid_b) = d_legs(world)
    assert da != db and rid_a == rid_b == p_legs(world)[0][1] and len(p_legs(world)) == 1
    assert reply.headers["X-PD-Reason"] == "first_turn"


@pytest.mark.parametrize("stream", [False, True])
async def test_d_failing_before_p_answered_is_redone_with_the_same_id_once_p_answered(stream):
    world = PushWorld()
    world.p_seconds = 0.05
    world.d_faults = [FAILED] if not stream else ["error event"]
    reply, _, _ = await turn(world, stream=stream)
    (da, rid_a), (db, rid_b) = d_legs(world)
    assert da != db and rid_a == rid_b and len(p_legs(world)) == 1
    assert b"ok" in reply.body


async def test_d_failing_after_the_write_redoes_the_pair_with_a_new_id():
    world = PushWorld()
    world.d_faults = [("after_write", FAILED)]
    reply, _, _ = await turn(world)
    (_, rid_a), (_, rid_b) = p_legs(world)
    assert rid_a != rid_b and [rid for _, rid in d_legs(world)] == [rid_a, rid_b]
    assert reply.headers["X-PD-Reason"] == "decode_failed"


async def test_p_answering_without_writing_ends_d_at_the_gateways_deadline():
    """vLLM never ends a D waiting for a WRITE: after P answered, D has decode_first_byte_timeout_s (0.3 s)."""
    world = PushWorld()
    world.never_writes = True
    with pytest.raises(EngineTimeoutError):
        await turn(world, retries=1)
    assert len(d_legs(world)) == 2 and len({rid for _, rid in world.legs()}) == 2
    assert world.cancelled == ["http://d0", "http://d0"]      # D aborted (before the error goes out) and kept:
    assert [url for url, _ in p_legs(world)] == ["http://p0", "http://p1"]      # P, whose WRITE never came, left


async def test_never_write_is_counted_as_an_abort_that_may_leave_blocks_held():
    world = PushWorld()
    world.never_writes = True
    runner, req, metrics = await built(world, retries=0)
    with pytest.raises(EngineTimeoutError):
        await runner.run(req, KEY)
    assert aborts(metrics, "no_write") == 1


async def test_a_restarted_p_with_a_new_identity_redoes_the_pair_and_is_learned():
    world = PushWorld()
    runner, req, _ = await built(world, retries=1)
    world.renamed = {"http://p0": "p-engine-2"}         # p0 (picked first) restarted between health checks
    reply = await runner.run(req, KEY)
    (pa, rid_a), (pb, rid_b) = p_legs(world)
    assert rid_a != rid_b and reply.headers["X-PD-Reason"] == "first_turn"     # nobody blamed: no retry lost
    assert pa == "http://p0" and runner.prefill_pool.get(pa).facts.push_target.engine_id == "p-engine-2"
    assert world.calls[-1][2]["kv_transfer_params"]["remote_engine_id"] == world.renamed.get(pb, "p-engine")


# -- the client leaving -------------------------------------------------------------------------------------
async def test_client_leaving_aborts_d_and_lets_p_finish():
    world = PushWorld()
    world.p_seconds = 0.2
    runner, req, metrics = await built(world)
    task = asyncio.create_task(runner.run(req, KEY))
    while len(world.calls) < 2:
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0)
    assert [url[:8] for url in world.cancelled] == ["http://d"]        # D aborted, P not
    await runner.drain()
    assert world.written[world.calls[0][1]].is_set()                   # P answered: its WRITE frees D's blocks
    assert aborts(metrics, "client_gone") == 1


# -- later turns --------------------------------------------------------------------------------------------
async def test_a_later_turn_goes_to_the_same_d_alone_without_flags_when_its_suffix_is_short():
    world = PushWorld()
    runner, req, _ = await built(world, local=256)
    first = await runner.run(req, KEY)
    decode = d_legs(world)[0][0]
    second = await runner.run(request(PROMPT + OUTPUT + [7, 8, 9]), KEY)
    assert (second.headers["X-PD-Plan"], second.headers["X-PD-Reason"]) == ("local", "short_suffix")
    url, _, body = world.calls[-1]
    assert url == decode and set(body["kv_transfer_params"]) == {"prompt_token_ids"}   # D alone, holds nothing
    assert second.headers["X-PD-Reused-Tokens"] == str((len(PROMPT) + len(OUTPUT) - 1) // BS * BS)
    assert first.headers["X-PD-Reason"] == "first_turn" and len(world.calls) == 3


async def test_a_later_turn_with_a_long_suffix_is_a_pair_for_push_mode():
    world = PushWorld()
    runner, req, _ = await built(world, local=2)
    await runner.run(req, KEY)
    second = await runner.run(request(PROMPT + OUTPUT + [7, 8, 9]), KEY)
    assert (second.headers["X-PD-Plan"], second.headers["X-PD-Reason"]) == ("full", "push_mode")
    assert second.headers["X-PD-Reused-Tokens"] == "0" and len(world.calls) == 4


async def test_a_failed_local_turn_becomes_a_pair_on_another_d():
    world = PushWorld()
    runner, req, _ = await built(world, local=256)
    await runner.run(req, KEY)
    world.d_faults = [FAILED]
    second = await runner.run(request(PROMPT + OUTPUT + [7, 8, 9]), KEY)
    assert (second.headers["X-PD-Plan"], second.headers["X-PD-Reason"]) == ("full", "decode_failed")
    assert d_legs(world)[-1][0] != d_legs(world)[-2][0] and len(p_legs(world)) == 2
