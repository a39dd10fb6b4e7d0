"""api/validation.py: the upstream APIs' cheap refusals, each naming its field."""

from __future__ import annotations

import msgspec
import pytest

from gateway.api.schemas import ChatRequest, parse
from gateway.api.validation import check_stop
from gateway.errors import InvalidRequestError

USER = {"role": "user", "content": "hi"}


@pytest.mark.parametrize(("fields", "param", "words"), [
    ({"messages": [USER, {"role": "wizard", "content": "x"}]}, "messages[1].role", "not a chat role"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url"}]}]},
     "messages[0].content[1]", "text-only"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}, "messages[0].content[0]", "text-only"),
    ({"messages": [USER], "temperature": -0.1}, "temperature", "at least 0"),
])
def test_refused_with_the_field_named(fields, param, words) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        parse(msgspec.json.encode({"model": "demo", **fields}), ChatRequest)
    assert caught.value.param == param and words in caught.value.message


@pytest.mark.parametrize("fields", [{"temperature": 0}, {"temperature": 1.5}, {"stop": ["a", "b", "c", "d"]},
                                    {"stop": "x"}, {"messages": [{"role": "developer", "content": "d"}, USER]},
                                    {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}]}])
def test_what_the_upstream_apis_accept_passes(fields) -> None:
    parse(msgspec.json.encode({"model": "demo", "messages": [USER], **fields}), ChatRequest)


def test_openais_stop_limit() -> None:
    check_stop({"stop": ["1", "2", "3", "4"]})
    with pytest.raises(InvalidRequestError) as caught:
        check_stop({"stop": ["1", "2", "3", "4", "5"]})
    assert caught.value.param == "stop"
