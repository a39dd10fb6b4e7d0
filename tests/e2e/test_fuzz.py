"""Fuzzing the HTTP surface from the gateway's own OpenAPI document (schemathesis strategies, driven by
hypothesis): whatever arrives, no 5xx caused by input, never a stack trace, every error OpenAI-shaped."""

from __future__ import annotations

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
