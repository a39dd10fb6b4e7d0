"""Fuzzing the HTTP surface from the gateway's own OpenAPI document (schemathesis strategies, driven by
hypothesis): whatever arrives, no 5xx caused by input, never a stack trace, every error in its API's shape (the
document describes every public path: Responses, Messages and admin too)."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.e2e.stack import stack

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def fuzz_stack():
    with stack(gateway=["--max-body-bytes", "65536"]) as s:
        yield s


@pytest.fixture(scope="module")
def operations(fuzz_stack):
    schema = schemathesis.openapi.from_url(fuzz_stack.gateway.url + "/openapi.json")
    return [result.ok() for result in schema.get_all_operations()]


def test_the_document_covers_the_turn_endpoints(operations):
    assert {op.path for op in operations} >= {"/v1/chat/completions", "/v1/completions", "/v1/models",
                                              "/v1/responses", "/v1/messages", "/v1/messages/count_tokens",
                                              "/admin/engines", "/metrics"}


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_any_input_gets_a_clean_answer(fuzz_stack, operations, data):
    operation = data.draw(st.sampled_from(operations))
    mode = data.draw(st.sampled_from(list(schemathesis.GenerationMode)))   # valid and invalid inputs
    case = data.draw(operation.as_strategy(mode))
    response = case.call(timeout=30)
    if response.status_code >= 500:
        pytest.fail(f"{case.path} {case.body!r} -> {response.status_code} {response.text[:300]}\n"
                    f"{fuzz_stack.gateway.log()[-3000:]}")
    assert "Traceback" not in response.text
    if response.status_code >= 400:
        body = response.json()
        if case.path.startswith("/v1/messages"):                # Anthropic's shape on every Messages path
            assert body["type"] == "error" and {"type", "message"} <= set(body["error"])
        else:
            assert {"message", "type", "param", "code"} <= set(body["error"])


def _nested(depth: int, where: str) -> bytes:
    deep = "[" * depth + "]" * depth
    message = '{"role": "user", "content": "hi"}'
    if where == "messages":
        return f'{{"model": "demo", "max_tokens": 4, "messages": {deep}}}'.encode()
    return f'{{"model": "demo", "max_tokens": 4, "metadata": {deep}, "messages": [{message}]}}'.encode()


@pytest.mark.parametrize("where", ["messages", "extra_field"])
@pytest.mark.parametrize("depth", [500, 1000, 100_000])
def test_deep_nesting_is_a_client_fault(fuzz_stack, depth, where):
    """1,000 levels once raised a RecursionError inside the JSON decoder (HTTP 500); 500 levels are fine."""
    body = _nested(depth, where)
    if len(body) > 65536:
        body = body[:65536 - 64] + b"]}"      # still malformed deep JSON, under the stack's body limit
    response = httpx.post(fuzz_stack.gateway.url + "/v1/chat/completions", content=body,
                          headers={"Content-Type": "application/json"}, timeout=30)
    assert "Traceback" not in response.text
    if depth == 500 and where == "extra_field":
        assert response.status_code == 200, response.text       # forwarded as sent, answered
    else:
        assert response.status_code == 400, response.text
        assert response.json()["error"]["type"] == "invalid_request_error"


# Bytes that are not UTF-8 text, and JSON escapes that are not characters, anywhere in a body (issue 28: invalid
# UTF-8 in a message was an unhandled decoder error, HTTP 500 with a traceback in the log).
BAD_TEXT = [
    b"\xff", b"\xc3", b"\xc3\x28", b"\xe2\x82", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80", b"\xc0\xaf", b"\x80",
    b"\xf4\x90\x80\x80", b"caf\xe9", b"\\ud800", b"\\udc00", b"\\ud83d", b"\\ud83dx", b"\\uDBFF\\u0041",
]
VALID_CHAT = (b'{"model": "demo", "max_tokens": 4, "messages": [{"role": "user", "content": "hi there"}], '
              b'"tools": [{"type": "function", "function": {"name": "f", "description": "a tool"}}], '
              b'"user": "someone", "metadata": {"tags": ["a", "b"]}}')
VALID_COMPLETION = b'{"model": "demo", "max_tokens": 4, "prompt": "once upon a time", "user": "someone"}'


def _text_spans(body: bytes) -> list[int]:
    """Offsets just inside every string of `body` (keys and values): where bad text is planted."""
    return [i + 1 for i, byte in enumerate(body) if byte == 0x22 and body[i + 1:i + 2] != b":"]


def _answer_is_clean(fuzz_stack, path: str, body: bytes) -> httpx.Response:
    response = httpx.post(fuzz_stack.gateway.url + path, content=body, headers={"Content-Type": "application/json"},
                          timeout=30)
    assert response.status_code < 500, f"{body!r} -> {response.status_code} {response.text[:300]}"
    assert "Traceback" not in response.text
    if response.status_code >= 400:
        assert {"message", "type", "param", "code"} <= set(response.json()["error"])
    return response


@pytest.mark.parametrize("bad", BAD_TEXT, ids=lambda b: b.hex())
@pytest.mark.parametrize(("path", "valid"), [("/v1/chat/completions", VALID_CHAT),
                                             ("/v1/completions", VALID_COMPLETION)], ids=["chat", "completion"])
def test_bad_text_anywhere_is_a_400_naming_its_field(fuzz_stack, path, valid, bad):
    for at in _text_spans(valid):
        body = valid[:at] + bad + valid[at:]
        response = _answer_is_clean(fuzz_stack, path, body)
        assert response.status_code == 400, body
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and "hex escape" not in error["message"]
        assert "UTF-8" in error["message"] or "surrogate" in error["message"], error


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_random_bytes_planted_in_a_valid_body_never_break_the_gateway(fuzz_stack, data):
    path, valid = data.draw(st.sampled_from([("/v1/chat/completions", VALID_CHAT),
                                             ("/v1/completions", VALID_COMPLETION)]))
    at = data.draw(st.integers(0, len(valid)))
    planted = data.draw(st.binary(min_size=1, max_size=8) | st.sampled_from(BAD_TEXT))
    _answer_is_clean(fuzz_stack, path, valid[:at] + planted + valid[at:])


def test_the_gateway_logged_no_traceback(fuzz_stack):
    """Run after the tests above (same module stack): no request, however bad, was an unhandled error."""
    assert "Traceback" not in fuzz_stack.gateway.log()
