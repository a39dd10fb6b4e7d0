"""SSE framing, request validation and what the client is allowed to see of D's answer."""

import msgspec
import pytest

from gateway.api.schemas import ChatRequest, CompletionRequest, parse
from gateway.engines.sse import EventSplitter
from gateway.errors import InvalidRequestError
from gateway.engines.kv import Handle
from gateway.turns.legs.capture import DecodeCapture
from gateway.turns.legs.bodies import decode_body, prefill_body
from gateway.turns.intake.request import TurnRequest


def test_sse_splitter_handles_arbitrary_cuts():
    stream = b'data: {"a":1}\n\ndata: {"b":2}\n\ndata: [DONE]\n\n'
    for cut in range(1, len(stream)):
        splitter = EventSplitter()
        events = splitter.feed(stream[:cut]) + splitter.feed(stream[cut:])
        assert events == [b'{"a":1}', b'{"b":2}', b"[DONE]"]


@pytest.mark.parametrize(("raw", "param"), [
    (b"{not json", None),
    (b"[]", None),
    (b'{"model":"m"}', "messages"),
    (b'{"messages":"hi"}', "messages"),
    (b'{"messages":[{"content":"x"}]}', "messages[0].role"),
    (b'{"messages":[{"role":"user","content":"x"}],"n":2}', "n"),
    (b'{"messages":[{"role":"user","content":"x"}],"max_tokens":0}', "max_tokens"),
    (b'{"messages":[{"role":"user","content":"x"}],"max_tokens":"many"}', "max_tokens"),
    (b'{"messages":[]}', "messages"),
])
def test_bad_chat_requests_name_the_field(raw, param):
    with pytest.raises(InvalidRequestError) as err:
        parse(raw, ChatRequest)
    assert err.value.param == param


def test_completion_prompt_forms():
    assert parse(b'{"prompt":"hi"}', CompletionRequest)[1].prompt == "hi"
    assert parse(b'{"prompt":[1,2]}', CompletionRequest)[1].prompt == [1, 2]
    with pytest.raises(InvalidRequestError):
        parse(b'{"prompt":[]}', CompletionRequest)


def _json(value):
    """What goes on the wire (the bodies hold pre-encoded msgspec.Raw parts)."""
    return msgspec.json.decode(msgspec.json.encode(value))


def _turn(**kw) -> TurnRequest:
    base = dict(endpoint="/v1/chat/completions", body={"messages": [], "stream": True, "max_tokens": 50,
                                                       "min_tokens": 3, "stream_options": {"include_usage": True}},
                model="m", prompt_ids=[1, 2, 3], stream=True, want_token_ids=False, include_usage=True,
                request_id="r")
    return TurnRequest(**{**base, **kw})


def test_prefill_body_is_one_token_non_streamed_with_pinned_ids():
    body = prefill_body(_turn(), Handle({"do_remote_decode": True}))
    assert body["max_tokens"] == 1 and body["stream"] is False
    assert "stream_options" not in body and "min_tokens" not in body
    assert _json(body["kv_transfer_params"]) == {"do_remote_decode": True, "prompt_token_ids": [1, 2, 3]}
    assert body["return_token_ids"] is True                  # P's prompt ids are confirmed before D's leg


def test_prefill_without_a_handle_asks_for_no_echo_of_the_prompt():
    body = prefill_body(_turn(), Handle({"do_remote_decode": True}), confirm_ids=False)
    assert body["return_token_ids"] is False


def test_decode_body_keeps_the_clients_request():
    body = decode_body(_turn(), Handle({"do_remote_prefill": True}))
    assert body["max_tokens"] == 50 and body["stream"] is True and body["min_tokens"] == 3
    assert body["return_token_ids"] is True
    assert body["kv_transfer_params"]["do_remote_prefill"] is True


def test_a_local_leg_that_holds_nothing_sends_only_the_pinned_ids():
    """D's KV events known (issue 36): D is asked for no handle, so it pins nothing and asks no lease (§9); the
    ids only to a D proven to pop them (before vLLM 0.32 they stay params, and a bidirectional D pins those)."""
    held = _json(decode_body(_turn(), None, local=True)["kv_transfer_params"])
    assert held["do_remote_decode"] is True and held["prompt_token_ids"] == [1, 2, 3]
    plain = decode_body(_turn(), None, local=True, hold=False, stub=True)
    assert _json(plain["kv_transfer_params"]) == {"prompt_token_ids": [1, 2, 3]}
    assert decode_body(_turn(), None, local=True, hold=False)["kv_transfer_params"] == {}
    completion = decode_body(_turn(endpoint="/v1/completions", body={"prompt": "abc"}), None, local=True, hold=False)
    assert completion["kv_transfer_params"] == {}


def test_completions_send_token_ids_as_prompt():
    body = prefill_body(_turn(endpoint="/v1/completions", body={"prompt": "abc"}), None)
    assert _json(body)["prompt"] == [1, 2, 3] and "prompt_token_ids" not in body["kv_transfer_params"]


def test_capture_strips_engine_internals_unless_asked():
    chunk = {"prompt_token_ids": [1], "kv_transfer_params": {"remote_host": "10.0.0.1"},
             "choices": [{"index": 0, "delta": {"content": "x"}, "token_ids": [7], "finish_reason": "stop"}]}
    capture = DecodeCapture()
    view = capture.take(chunk, want_token_ids=False)
    assert "kv_transfer_params" not in view and "prompt_token_ids" not in view
    assert "token_ids" not in view["choices"][0]
    assert capture.handle.wire == {"remote_host": "10.0.0.1"} and capture.output_ids == [7] and capture.finished


def test_token_id_prompts_outside_the_vocabulary_are_400():
    from gateway.turns.intake.render import Renderer

    renderer = Renderer("builtin:demo")
    assert renderer.render_prompt([1, 2, 3]) == [1, 2, 3]
    for bad in ([-1], [renderer.vocab_size], [2**70]):
        with pytest.raises(InvalidRequestError) as err:
            renderer.render_prompt(bad)
        assert err.value.param == "prompt"


@pytest.mark.parametrize(("endpoint", "choice"), [
    ("/v1/chat/completions", {"index": 0, "message": {"role": "assistant", "content": "a b"}, "finish_reason": "stop",
                              "logprobs": {"content": [{"token": "a", "logprob": -0.1, "top_logprobs": []},
                                                       {"token": " b", "logprob": -0.3, "top_logprobs": []}]}}),
    ("/v1/completions", {"index": 0, "text": "a b", "finish_reason": "stop",
                         "logprobs": {"tokens": ["a", " b"], "token_logprobs": [-0.1, -0.3],
                                      "top_logprobs": [{"a": -0.1}, {" b": -0.3}], "text_offset": [0, 1]}}),
])
def test_the_buffer_policy_keeps_logprobs(endpoint, choice):
    """`--stream-handle-policy buffer` re-streams D's whole answer: its logprobs were dropped (always None)."""
    from gateway.turns.legs.restream import chunks

    out = chunks({"id": "x", "created": 1, "model": "m", "choices": [choice]}, _turn(endpoint=endpoint))
    assert out[0]["choices"][0]["logprobs"] == choice["logprobs"]
