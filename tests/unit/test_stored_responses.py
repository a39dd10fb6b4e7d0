"""turns/state/stored_responses.py: a stored response keeps D's exact ids (prompt + output) and the conversation's
messages; a continued turn's prompt is those ids and the new items, from this process's cache or, in another
process, from the store's bytes, alike; tenants, deletes and expired responses are 404s; two branches from one
response do not see each other's tokens."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from gateway.api import responses as api
from gateway.api.schemas import ChatRequest, parse
from gateway.errors import NotFoundError
from gateway.store import MemoryConversationStore
from gateway.telemetry import Metrics
from gateway.turns.intake.continued import Continuation
from gateway.turns.intake.intake import Intake
from gateway.turns.intake.render import Renderer
from gateway.turns.legs.capture import DecodeCapture
from gateway.turns.state.stored_responses import StoredResponses


@pytest.fixture(scope="module")
def continuation() -> Continuation:
    return Continuation(Intake(Renderer("builtin:demo"), ["demo"]))


def turn(continuation, previous, text: str, instructions: str = "Be brief."):
    req = api.parse_request(msgspec.json.encode({"input": text, "instructions": instructions}))
    body, parsed = parse(msgspec.json.encode(api.chat_body(req, "demo")), ChatRequest)
    return continuation.turn(previous, instructions, body, parsed, "r")


def answer(continuation, request, text: str) -> DecodeCapture:
    tok = continuation.intake.renderer.tokenizer
    return DecodeCapture(prompt_ids=list(request.prompt_ids), output_ids=[*tok.encode(text), tok.eos_token_id],
                         output_ids_seen=True, finish_reason="stop", text=[text])


def whole(continuation, messages) -> list[int]:
    r = continuation.intake.renderer
    return r.tokenizer.encode(continuation.render(messages), add_special_tokens=False)


def test_a_chain_continues_exact_ids_in_process_and_from_the_store(continuation) -> None:
    async def run():
        store = MemoryConversationStore()
        here, there = StoredResponses(store, Metrics()), StoredResponses(store, Metrics())   # two replicas
        history = [{"role": "system", "content": "Be brief."}]
        previous_id = None
        for i, (question, reply) in enumerate([("Hi there", "Hello friend"), ("More?", "Yes indeed"),
                                               ("Last one", "Sure")]):
            previous = await here.load("acme", previous_id) if previous_id else None
            request, thread = turn(continuation, previous, question)
            elsewhere = await there.load("acme", previous_id) if previous_id else None   # from the store's bytes
            if elsewhere is not None:
                assert list(turn(continuation, elsewhere, question)[0].prompt_ids) == list(request.prompt_ids)
            history.append({"role": "user", "content": question})
            assert list(request.prompt_ids) == whole(continuation, history)
            assert (thread.continued, request.rerender is None) == (i > 0, i > 0)
            previous_id = api.new_id("resp")
            assert await here.save("acme", previous_id, "chain", request, thread,
                                   answer(continuation, request, reply), b'{"id": 1}')
            history.append({"role": "assistant", "content": reply})
        stored = await store.get_response("acme", previous_id)
        assert msgspec.json.decode(stored.messages) == history[1:]     # instructions kept apart (the context)
        assert await here.body("acme", previous_id) == b'{"id": 1}'
    asyncio.run(run())


def test_branches_do_not_share_tokens(continuation) -> None:
    async def run():
        stored = StoredResponses(MemoryConversationStore(), Metrics())
        root, thread = turn(continuation, None, "Start")
        await stored.save("acme", "resp_root", "chain", root, thread, answer(continuation, root, "Once upon"), b"{}")
        a, _ = turn(continuation, await stored.load("acme", "resp_root"), "Sad")
        b, _ = turn(continuation, await stored.load("acme", "resp_root"), "Happy")
        base = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Start"},
                {"role": "assistant", "content": "Once upon"}]
        assert list(a.prompt_ids) == whole(continuation, [*base, {"role": "user", "content": "Sad"}])
        assert list(b.prompt_ids) == whole(continuation, [*base, {"role": "user", "content": "Happy"}])
        assert a.prompt_json == msgspec.json.encode(list(a.prompt_ids))
        assert b.prompt_json == msgspec.json.encode(list(b.prompt_ids))
    asyncio.run(run())


def test_unknown_foreign_deleted_and_unstored_answers(continuation) -> None:
    async def run():
        stored = StoredResponses(MemoryConversationStore(), Metrics())
        request, thread = turn(continuation, None, "Hi")
        await stored.save("acme", "resp_1", "chain", request, thread, answer(continuation, request, "Hey"), b"{}")
        for tenant, rid in (("other", "resp_1"), ("acme", "resp_2"), ("acme", "bad id!")):
            with pytest.raises(NotFoundError):
                await stored.load(tenant, rid)
        await stored.delete("acme", "resp_1")
        with pytest.raises(NotFoundError):
            await stored.load("acme", "resp_1")
        failed = DecodeCapture(prompt_ids=None, error=True)      # D gave no ids: stored, rendered whole next time
        await stored.save("acme", "resp_3", "chain", request, thread, failed, b"{}")
        previous = await stored.load("acme", "resp_3")
        assert previous.ids is None and not turn(continuation, previous, "Again")[1].continued
    asyncio.run(run())


def test_changed_instructions_render_whole(continuation) -> None:
    async def run():
        stored = StoredResponses(MemoryConversationStore(), Metrics())
        request, thread = turn(continuation, None, "Hi")
        await stored.save("acme", "resp_1", "chain", request, thread, answer(continuation, request, "Hey"), b"{}")
        later, later_thread = turn(continuation, await stored.load("acme", "resp_1"), "Next", "Be formal.")
        assert not later_thread.continued
        assert list(later.prompt_ids) == whole(continuation, [
            {"role": "system", "content": "Be formal."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hey"}, {"role": "user", "content": "Next"}])
    asyncio.run(run())
