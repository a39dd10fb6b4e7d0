"""TurnRunner's retry and replan state machine, without processes: a scripted engine client, real pools, the
embedded store. One test per transition of plan.replan as the runner carries it out."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import msgspec
import pytest

from gateway.config import Settings
from gateway.engines.pool import EnginePool
from gateway.errors import EngineConnectError, EngineFailedError, EngineTimeoutError, GatewayError
from gateway.store import Conversation, ConversationKey, MemoryConversationStore
from gateway.telemetry import Metrics
from gateway.turns.legs.calls import EngineCalls
from gateway.turns.reuse.continuity import Fingerprint
from gateway.turns.legs.release import HandleReleaser
from gateway.turns.intake.request import TurnRequest
from gateway.turns.state.state import ConversationState
from gateway.turns.runner import TurnRunner

BS = 4
HISTORY = list(range(100, 120))                 # what D holds from the last turn: R = 20 tokens
PROMPT = HISTORY + [7, 8, 9]
KEY = ConversationKey("t", "s")
D_HANDLE = {"do_remote_decode": True, "remote_engine_id": "d0", "remote_block_ids": [[1, 2, 3, 4, 5]],
            "remote_num_tokens": 20, "remote_host": "h", "remote_port": 1}
P_HANDLE = {"do_remote_prefill": True, "remote_engine_id": "p", "remote_block_ids": [[9]],
            "remote_num_tokens": len(PROMPT)}

Script = Callable[[str, dict[str, Any]], dict[str, Any] | GatewayError]


class ScriptedClient:
    """Answers each engine call from `script(url, body)`: an answer, or an error to raise."""

    def __init__(self, script: Script) -> None:
        self.script, self.calls = script, []

    async def post_json(self, url: str, path: str, body: dict[str, Any], **_: Any) -> dict[str, Any]:
        self.calls.append((url, body))
        await asyncio.sleep(0)           # the answer takes a trip: other tasks run meanwhile, as on a network
        outcome = self.script(url, body)
        if isinstance(outcome, GatewayError):
            raise outcome
        return outcome


def prefill_answer(url: str, body: dict[str, Any]) -> dict[str, Any]:
    return {"choices": [{"message": {"content": "x"}, "finish_reason": "length"}], "prompt_token_ids": PROMPT,
            "kv_transfer_params": dict(P_HANDLE)}


def decode_answer(url: str, body: dict[str, Any]) -> dict[str, Any]:
    return {"choices": [{"message": {"content": "ok"}, "finish_reason": "stop", "token_ids": [5, 6]}],
            "prompt_token_ids": PROMPT,
            "kv_transfer_params": {**D_HANDLE, "remote_num_tokens": len(PROMPT) + 1}}


def reads_d(body: dict[str, Any]) -> bool:
    return body["kv_transfer_params"].get("remote_engine_id") == "d0"


async def built(script: Script, *, retries: int = 2, proven: bool = False, prompt: list[int] = PROMPT,
                local: int = 0, gap: float = 1.0,
                decode_proven: bool = False) -> tuple[ScriptedClient, TurnRunner, TurnRequest]:
    settings = Settings(prefill=["http://p0", "http://p1"], decode=["http://d0", "http://d1"], max_retries=retries,
                        prefill_affinity=False, local_prefill_max_tokens=local)
    store, metrics, client = MemoryConversationStore(), Metrics(), ScriptedClient(script)
    held = Fingerprint.of(HISTORY, 20, BS)
    start = await store.begin_turn(KEY, 0.0)
    await store.finish_turn(KEY, start.turn, Conversation(
        decode_engine="http://d0", model="m", block_size=BS, num_tokens=20, held_tokens=20,
        block_hashes=held.block_hashes, prefix_hash=held.prefix_hash, updated_at=time.time() - gap),
        dict(D_HANDLE), 1e12, 0.0)
    prefill, decode = EnginePool("prefill", settings.prefill), EnginePool("decode", settings.decode)
    for engine in prefill.engines.values():
        engine.facts.pinned_ids = proven        # what the start-up probe found (startup.PinnedIdsProof)
    for engine in decode.engines.values():
        engine.facts.pinned_ids = decode_proven
    calls = EngineCalls(metrics)
    releaser = HandleReleaser(client, prefill, calls, metrics, "m")
    state = ConversationState(store=store, decode=decode, releaser=releaser, metrics=metrics, settings=settings,
                              block_size=BS, renderer=None)
    runner = TurnRunner(client=client, prefill=prefill, decode=decode, state=state, calls=calls,
                        releaser=releaser, metrics=metrics, settings=settings)
    req = TurnRequest(endpoint="/v1/chat/completions", body={"model": "m", "messages": []}, model="m",
                      prompt_ids=prompt, stream=False, want_token_ids=False, include_usage=False, request_id="r")
    return client, runner, req


async def run_turn(script: Script, **how: Any) -> tuple[ScriptedClient, TurnRunner, Any]:
    client, runner, req = await built(script, **how)
    reply = await runner.run(req, KEY)
    await runner.drain()
    return client, runner, reply


def by_leg(prefill: Callable[[str, dict], Any], decode: Callable[[str, dict], Any] = decode_answer) -> Script:
    return lambda url, body: prefill(url, body) if "://p" in url else decode(url, body)


def failing_first(error: GatewayError, then: Callable[[str, dict], Any]) -> Callable[[str, dict], Any]:
    seen: list[str] = []

    def step(url: str, body: dict) -> Any:
        seen.append(url)
        return error if len(seen) == 1 else then(url, body)
    return step


def legs(client: ScriptedClient) -> list[tuple[str, bool]]:
    """(engine, whether the call read D's KV), release reads (to /v1/completions) left out."""
    return [(url, reads_d(body)) for url, body in client.calls if "messages" in body]


async def test_continuous_turn_reads_d_and_decodes_on_the_holder():
    client, _, reply = await run_turn(by_leg(prefill_answer))
    assert reply.headers["X-PD-Plan"] == "reuse"
    assert legs(client)[0][1] and legs(client)[1][0] == "http://d0"


async def test_prefill_refused_goes_to_another_p_with_the_same_handle():
    client, _, reply = await run_turn(by_leg(failing_first(EngineConnectError("refused"), prefill_answer)))
    (p1, read1), (p2, read2) = legs(client)[:2]
    assert p1 != p2 and read1 and read2 and reply.headers["X-PD-Plan"] == "reuse"


async def test_prefill_timeout_on_a_handle_redoes_p_without_it():
    client, _, reply = await run_turn(by_leg(failing_first(EngineTimeoutError("slow"), prefill_answer)))
    assert [read for _, read in legs(client)[:2]] == [True, False]
    assert (reply.headers["X-PD-Plan"], reply.headers["X-PD-Reason"]) == ("full", "prefill_failed")


async def test_prefill_failure_on_a_handle_redoes_p_elsewhere_without_it():
    client, _, reply = await run_turn(by_leg(failing_first(EngineFailedError("500"), prefill_answer)))
    (p1, _), (p2, read2) = legs(client)[:2]
    assert p1 != p2 and not read2 and reply.headers["X-PD-Reason"] == "prefill_failed"


async def test_parity_violation_redoes_p_without_the_handle_and_spends_no_retry():
    def other_tokens(url: str, body: dict) -> dict:
        answer = prefill_answer(url, body)
        if reads_d(body):
            answer["prompt_token_ids"] = PROMPT[:-1] + [0]
        return answer
    client, _, reply = await run_turn(by_leg(other_tokens), retries=0)
    assert [read for _, read in legs(client)[:2]] == [True, False]
    assert reply.headers["X-PD-Reason"] == "parity_violation"


@pytest.mark.parametrize("proven", [False, True])
async def test_p_echoes_its_prompt_for_the_parity_check_only_where_it_is_not_proven_to_use_pinned_ids(proven):
    def answer(url: str, body: dict) -> dict:
        reply = prefill_answer(url, body)
        if not body["return_token_ids"]:
            del reply["prompt_token_ids"]      # an engine echoes only when asked
        return reply
    client, _, reply = await run_turn(by_leg(answer), proven=proven)
    first = client.calls[0][1]
    assert reads_d(first) and first["return_token_ids"] is not proven
    assert first["kv_transfer_params"]["prompt_token_ids"] is not None       # pinned either way
    assert reply.headers["X-PD-Plan"] == "reuse"


async def test_a_proven_p_is_not_checked_against_an_echo():
    """Proof replaces the check: no echo is asked, so a (stray) one is not read."""
    def stray(url: str, body: dict) -> dict:
        return {**prefill_answer(url, body), "prompt_token_ids": PROMPT[:-1] + [0]}
    _, _, reply = await run_turn(by_leg(stray), proven=True)
    assert (reply.headers["X-PD-Plan"], reply.headers["X-PD-Reason"]) == ("reuse", "continuous")


async def test_decode_refused_goes_to_another_d_with_ps_handle():
    client, _, reply = await run_turn(by_leg(prefill_answer, failing_first(EngineConnectError("no"), decode_answer)))
    engines = [url for url, _ in legs(client)]
    assert engines[0].startswith("http://p") and engines[1:] == ["http://d0", "http://d1"]
    assert reply.headers["X-PD-Plan"] == "reuse"


async def test_decode_failure_prefills_afresh_then_another_d():
    client, _, reply = await run_turn(by_leg(prefill_answer, failing_first(EngineFailedError("500"), decode_answer)))
    engines = [(url[:8], read) for url, read in legs(client)]
    assert engines == [("http://p", True), ("http://d", False), ("http://p", False), ("http://d", False)]
    assert legs(client)[3][0] == "http://d1" and reply.headers["X-PD-Reason"] == "decode_failed"


async def test_out_of_retries_the_last_engine_error_reaches_the_client():
    with pytest.raises(EngineFailedError):
        await run_turn(by_leg(lambda url, body: EngineFailedError("500")), retries=1)


async def test_a_salted_turn_without_a_session_id_is_not_looked_up_by_its_tokens():
    settings = Settings(prefill=["http://p0"], decode=["http://d0"])
    store, metrics = MemoryConversationStore(), Metrics()
    prefill, decode = EnginePool("prefill", settings.prefill), EnginePool("decode", settings.decode)
    releaser = HandleReleaser(ScriptedClient(prefill_answer), prefill, EngineCalls(metrics), metrics, "m")
    state = ConversationState(store=store, decode=decode, releaser=releaser, metrics=metrics, settings=settings,
                              block_size=BS, renderer=None)

    def request(body: dict) -> TurnRequest:
        return TurnRequest(endpoint="/v1/chat/completions", body=body, model="m", prompt_ids=PROMPT, stream=False,
                           want_token_ids=False, include_usage=False, request_id="r")
    assert await state.begin(request({"messages": [], "cache_salt": "user-7"}), None) == (None, None)
    found, _ = await state.begin(request({"messages": []}), None)
    assert found is not None and found.how == "new"


DIVERGED = [1] + HISTORY[1:] + [7, 8, 9]         # differs from D's tokens in the first block: D's handle is unused


def releases(client: ScriptedClient) -> list[int]:
    """Where in the call sequence the zero-token releases of D's handle went."""
    return [i for i, (_, body) in enumerate(client.calls) if body["kv_transfer_params"].get("remote_num_tokens") == 0]


async def test_an_unused_handle_is_released_only_once_d_has_answered():
    client, _, reply = await run_turn(by_leg(prefill_answer), prompt=DIVERGED)
    assert reply.headers["X-PD-Reason"] == "prefix_diverged"
    assert "://d" in client.calls[1][0]
    assert releases(client) == [2]           # after P's leg and D's answer, not beside them


async def test_an_unused_handle_is_released_when_the_turn_fails_too():
    client, runner, req = await built(by_leg(prefill_answer, lambda url, body: EngineFailedError("500")),
                                      prompt=DIVERGED, retries=0)
    with pytest.raises(GatewayError):
        await runner.run(req, KEY)
    await runner.drain()
    assert len(releases(client)) == 1


# -- the local path: the holder D alone ------------------------------------------------------------------------
async def test_a_short_suffix_goes_to_the_holder_alone_and_its_old_handle_goes_after():
    client, _, reply = await run_turn(by_leg(prefill_answer), local=64)
    assert reply.headers["X-PD-Plan"] == "local" and reply.headers["X-PD-Reason"] == "short_suffix"
    (url, body), = [(u, b) for u, b in client.calls if "messages" in b]
    assert url == "http://d0" and not reads_d(body)
    params = body["kv_transfer_params"]          # held for the next turn's reader, as P is asked on a first turn
    assert params["do_remote_decode"] is True and params["remote_block_ids"] is None
    assert releases(client) == [1]                 # after D's answer, through a P
    assert "://p" in client.calls[1][0]
    assert reply.headers["X-PD-Reused-Tokens"] == "20"          # D's whole blocks: 5 of 4 tokens


async def test_turns_further_apart_than_d_s_lease_take_the_p_path():
    """A local turn's handle lives D's lease (10 s usable by default), the P path's the decoder TTL."""
    client, _, reply = await run_turn(by_leg(prefill_answer), local=64, gap=60.0)
    assert reply.headers["X-PD-Plan"] == "reuse" and reply.headers["X-PD-Reason"] == "lease_too_short"
    assert legs(client)[0][1]


async def test_a_suffix_over_the_bound_takes_the_p_path():
    client, _, reply = await run_turn(by_leg(prefill_answer), local=2)
    assert reply.headers["X-PD-Plan"] == "reuse" and legs(client)[0][1]


async def test_a_holder_over_its_load_bound_sends_the_turn_the_long_way():
    client, runner, req = await built(by_leg(prefill_answer), local=64)
    runner.decode_pool.get("http://d0").outstanding_requests = runner.settings.decode_load_bound + 1
    reply = await runner.run(req, KEY)
    await runner.drain()
    assert reply.headers["X-PD-Plan"] == "reuse"
    assert legs(client)[0][1] and legs(client)[1][0] == "http://d1"     # P reads d0's KV for d1


@pytest.mark.parametrize(("error", "plan", "p_reads"), [
    (EngineFailedError("boom"), "reuse", True),      # the handle was never read: P reads it, for another D
    (EngineConnectError("refused"), "full", False),  # the holder is gone, and its KV with it
])
async def test_a_failed_local_leg_falls_back_to_the_p_path(error, plan, p_reads):
    client, _, reply = await run_turn(by_leg(prefill_answer, failing_first(error, decode_answer)), local=64)
    assert reply.headers["X-PD-Plan"] == plan and reply.headers["X-PD-Reason"] == "decode_failed"
    (d_first, _), (p, read), (d_then, _) = legs(client)
    assert d_first == "http://d0" and "://p" in p and read is p_reads and d_then == "http://d1"
    if p_reads:
        assert not releases(client)              # the handle P read is spent: nothing to release


async def test_a_local_turn_s_handle_is_stored_as_d_s_own_for_d_s_lease():
    """D returns a producer's handle for the local path (do_remote_prefill, no expiry, held for its lease):
    stored with D's own flags, for the lease less the P read's margin, not for the decoder TTL."""
    def lease_answer(url: str, body: dict[str, Any]) -> dict[str, Any]:
        answer = decode_answer(url, body)
        answer["kv_transfer_params"] = {**answer["kv_transfer_params"], "do_remote_prefill": True,
                                        "do_remote_decode": False, "remote_blocks_expiry_time": None}
        return answer
    client, runner, req = await built(by_leg(prefill_answer, lease_answer), local=64)
    began = time.time()
    await runner.run(req, KEY)
    await runner.drain()
    store = runner.state.store
    _, wire, _ = await store.get(KEY)
    assert wire["do_remote_decode"] is True and wire["do_remote_prefill"] is False
    entry = store._entries[KEY]
    assert began < entry.handle_expires_at <= time.time() + runner.settings.lease_ttl_s
    assert runner.settings.lease_ttl_s == 30 - 15 - 5


HISTORY_MESSAGES = [{"role": "system", "content": "s"}, {"role": "user", "content": "u1"},
                    {"role": "assistant", "content": "a1"}, {"role": "user", "content": "u2"}]


@pytest.mark.parametrize(("p_proven", "d_proven"), [(False, False), (True, False), (False, True), (True, True)])
async def test_only_an_engine_proven_to_use_the_pinned_ids_is_sent_no_history_text(p_proven, d_proven):
    """The ids carry the history to an engine that uses them; one that renders needs every message."""
    client, runner, req = await built(by_leg(prefill_answer), proven=p_proven, decode_proven=d_proven)
    req.body["messages"] = list(HISTORY_MESSAGES)
    await runner.run(req, KEY)
    await runner.drain()
    sent = {("p" if "://p" in url else "d"): body for url, body in client.calls if "messages" in body}
    for leg, proven in (("p", p_proven), ("d", d_proven)):
        messages = msgspec.json.decode(msgspec.json.encode(sent[leg]["messages"]))
        assert messages == (HISTORY_MESSAGES[-1:] if proven else HISTORY_MESSAGES), leg
        pinned = msgspec.json.decode(msgspec.json.encode(sent[leg]["kv_transfer_params"]["prompt_token_ids"]))
        assert pinned == PROMPT, leg                      # the stub only ever travels with the verified ids
