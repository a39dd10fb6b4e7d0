"""Fuzzing the HTTP surface from the gateway's own OpenAPI document (schemathesis strategies, driven by
hypothesis): whatever arrives, no 5xx caused by input, never a stack trace, every error OpenAI-shaped."""

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
    assert {op.path for op in operations} >= {"/v1/chat/completions", "/v1/completions", "/v1/models"}


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
        error = response.json()["error"]
        assert {"message", "type", "param", "code"} <= set(error)


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
