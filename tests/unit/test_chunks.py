"""D's streamed chunks: a plain middle chunk leaves as D's own bytes (its ids cut out unless wanted) and tells the
capture exactly what the whole way would; anything else is decoded, edited, re-encoded."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.turns.legs import chunks
from gateway.turns.legs.capture import DecodeCapture

_decode = msgspec.json.decode


def chunk(delta: dict | None = None, *, ids: list[int] | None = (7,), finish: str | None = None,
          top: dict | None = None, text: str | None = None) -> bytes:
    """A chunk as vLLM (and the simulator) write it: pydantic's compact JSON, token_ids last in the choice."""
    choice: dict = {"index": 0}
    if text is None:
        choice["delta"] = delta if delta is not None else {"content": "hi"}
    else:
        choice["text"] = text
    choice.update(logprobs=None, finish_reason=finish)
    if ids is not None:
        choice["token_ids"] = list(ids)
    return msgspec.json.encode({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1,
                                "model": "m", "choices": [choice], **(top or {})})


def whole_way(raw: bytes, want: bool) -> tuple[bytes, DecodeCapture]:
    capture = DecodeCapture()
    return msgspec.json.encode(capture.take(_decode(raw), want)), capture


def relayed(raw: bytes, want: bool) -> tuple[bytes, DecodeCapture, bool]:
    capture, decoded = DecodeCapture(), []

    def decode(b: bytes) -> dict:
        decoded.append(b)
        return _decode(b)
    return chunks.relay(capture, raw, want, decode), capture, bool(decoded)


def same_capture(a: DecodeCapture, b: DecodeCapture) -> None:
    assert (a.output_ids, a.output_ids_seen, a.text, a.finish_reason, a.prompt_ids, a.tool_calls, a.error) == \
        (b.output_ids, b.output_ids_seen, b.text, b.finish_reason, b.prompt_ids, b.tool_calls, b.error)


def test_a_plain_chunk_leaves_byte_for_byte_when_the_client_wants_ids() -> None:
    raw = chunk({"content": "hello"}, ids=[11])
    out, capture, decoded = relayed(raw, want=True)
    assert out == raw and not decoded
    assert capture.output_ids == [11] and capture.text == ["hello"] and capture.output_ids_seen


def test_ids_the_client_did_not_ask_for_are_cut_from_the_bytes() -> None:
    raw = chunk({"content": "hello"}, ids=[11, 12])
    out, capture, decoded = relayed(raw, want=False)
    assert not decoded and out == whole_way(raw, want=False)[0]
    assert "token_ids" not in _decode(out)["choices"][0] and capture.output_ids == [11, 12]


@pytest.mark.parametrize("raw", [
    b'{"choices":[{"token_ids":[5],"index":0,"delta":{"content":"a"}}]}',               # the ids first
    b'{"choices":[{"index":0,"delta":{"content":"a"},"token_ids": [5]}]}',              # a space
    b'{"choices":[{"index":0,"delta":{"content":"a"},"token_ids":[5]}],"token_ids":[6]}',   # a second member
    b'{"choices":[{"index":0,"delta":{"content":"a"},"logprobs":{"token_ids":[1]},"token_ids":[5]}]}',
    b'{"choices":[{"index":0,"delta":{"content":"token_ids"},"token_ids":[5]}]}',       # the key's text as text
])
def test_ids_in_any_other_layout_go_the_whole_way(raw: bytes) -> None:
    out, capture, decoded = relayed(raw, want=False)
    expected, reference = whole_way(raw, want=False)
    assert decoded and out == expected
    same_capture(capture, reference)


def test_a_chunk_without_ids_passes_through_either_way() -> None:
    raw = chunk({"content": "hello"}, ids=None)
    for want in (False, True):
        out, capture, decoded = relayed(raw, want)
        assert out == raw and not decoded and capture.text == ["hello"] and not capture.output_ids_seen


@pytest.mark.parametrize("raw", [
    chunk({"role": "assistant", "content": ""}, ids=None, top={"prompt_token_ids": [1, 2, 3]}),   # D's echo
    chunk({"content": ""}, finish="stop"),                                                        # the last
    chunk({"content": ""}, finish="stop", top={"kv_transfer_params": {"remote_block_ids": [1]}}),
    chunk({"tool_calls": [{"index": 0, "function": {"name": "f", "arguments": "{"}}]}),
    b'{"error":{"message":"boom","type":"x","code":500}}',
    b'{"choices":[{"index":0,"delta":{"content":"a"},"token_ids":[1]},{"index":1,"delta":{"content":"b"}}]}',
])
def test_anything_else_is_edited_the_whole_way(raw: bytes) -> None:
    for want in (False, True):
        out, capture, decoded = relayed(raw, want)
        expected, reference = whole_way(raw, want)
        assert decoded, "should have gone the whole way"
        assert out == expected
        same_capture(capture, reference)


@pytest.mark.parametrize("raw", [
    b'{"choices":[{"token_ids":[5],"index":0,"delta":{"content":"a"}}]}',
    b'{"choices":[{"index":0,"delta":{"content":"a"},"token_ids": [5]}]}',
    b'{"choices":[{"index":0,"delta":{"content":"x\\",\\"token_ids\\":[1]"},"token_ids":[5]}]}',
])
def test_when_the_client_wants_the_ids_any_plain_layout_passes(raw: bytes) -> None:
    out, capture, decoded = relayed(raw, want=True)
    assert out == raw and not decoded
    same_capture(capture, whole_way(raw, want=True)[1])


def test_the_echo_and_handle_are_still_edited_out() -> None:
    raw = chunk({"content": ""}, finish="length", top={"prompt_token_ids": [1, 2], "kv_transfer_params": {"a": 1}})
    out, capture, _ = relayed(raw, want=False)
    body = _decode(out)
    assert "prompt_token_ids" not in body and "token_ids" not in body["choices"][0]
    assert capture.prompt_ids == [1, 2] and capture.finish_reason == "length"


_texts = st.text(alphabet=st.characters(codec="utf-8"), max_size=12)


@given(content=_texts, ids=st.lists(st.integers(0, 200_000), max_size=3), want=st.booleans(),
       completions=st.booleans(), logprobs=st.one_of(st.none(), st.just({"content": [{"token": "a"}]})))
def test_relay_means_what_the_whole_way_means(content: str, ids: list[int], want: bool, completions: bool,
                                               logprobs: dict | None) -> None:
    raw = chunk(text=content, ids=ids) if completions else chunk({"content": content}, ids=ids)
    if logprobs is not None:
        body = _decode(raw)
        body["choices"][0]["logprobs"] = logprobs
        raw = msgspec.json.encode(body)
    out, capture, _ = relayed(raw, want)
    expected, reference = whole_way(raw, want)
    assert _decode(out) == _decode(expected)
    same_capture(capture, reference)


@pytest.mark.parametrize("details", [None, {"cached_tokens": 401, "audio_tokens": 0}])
def test_usage_reports_the_turns_cached_tokens_not_ds(details) -> None:
    # D (with --enable-prompt-tokens-details) counts every token P sent it as cached; the gateway's figure wins
    capture = DecodeCapture(cached_tokens=96)
    raw = msgspec.json.encode({"choices": [], "usage": {"prompt_tokens": 402, "completion_tokens": 5,
                                                        "prompt_tokens_details": details}})
    out = msgspec.json.decode(chunks.relay(capture, raw, False, msgspec.json.decode))
    assert out["usage"]["prompt_tokens_details"] == {**(details or {}), "cached_tokens": 96}
