"""A body whose text is broken (bytes that are not UTF-8, half a surrogate pair) is the client's fault: a 400 that
names the field, never a 500 (issue 28: invalid UTF-8 in a message was an unhandled DecodeError)."""

from __future__ import annotations

import pytest

from gateway.api import jsontext
from gateway.api.schemas import ChatRequest, CompletionRequest, parse
from gateway.errors import InvalidRequestError

MSG = b'{"role": "user", "content": "hi"}'


@pytest.mark.parametrize(("raw", "param"), [
    (b'{"model": "demo", "messages": [{"role": "user", "content": "caf\xe9"}]}', "messages[0].content"),
    (b'{"model": "de\xffmo", "messages": [' + MSG + b']}', "model"),
    (b'{"messages": [' + MSG + b', {"role": "user", "content": [{"type": "text", "text": "\xc3"}]}]}',
     "messages[1].content[0].text"),
    (b'{"messages": [' + MSG + b'], "tools": [{"function": {"name": "f", "description": "\xed\xa0\x80"}}]}',
     "tools[0].function.description"),                 # a surrogate encoded as UTF-8 (CESU-8) is not UTF-8
    (b'{"messages": [' + MSG + b'], "metadata": {"a": ["x", "\xf8\x88\x80\x80\x80"]}}', "metadata.a[1]"),
    (b'{"messages": [{"role": "us\x80er", "content": "hi"}]}', "messages[0].role"),
])
def test_invalid_utf8_is_a_400_naming_the_field(raw, param):
    with pytest.raises(InvalidRequestError) as caught:
        parse(raw, ChatRequest)
    assert caught.value.status == 400
    assert caught.value.param == param
    assert f"`{param}` is not valid UTF-8" in caught.value.message


def test_invalid_utf8_in_a_completion_prompt():
    with pytest.raises(InvalidRequestError) as caught:
        parse(b'{"model": "demo", "prompt": "\xfe once"}', CompletionRequest)
    assert caught.value.param == "prompt"


@pytest.mark.parametrize(("raw", "param", "half"), [
    (rb'{"messages": [{"role": "user", "content": "\ud800"}]}', "messages[0].content", "high"),
    (rb'{"messages": [{"role": "user", "content": "a\ud83dz"}]}', "messages[0].content", "high"),
    (rb'{"messages": [{"role": "user", "content": "\udc00 after"}]}', "messages[0].content", "low"),
    (rb'{"model": "demo", "messages": [{"role": "user", "content": "x"}], "user": "\uDBFF"}', "user", "high"),
])
def test_a_lone_surrogate_escape_says_what_is_wrong(raw, param, half):
    with pytest.raises(InvalidRequestError) as caught:
        parse(raw, ChatRequest)
    message = caught.value.message
    assert caught.value.param == param
    assert f"a {half} surrogate alone" in message and "hex escape" not in message and "truncated" not in message


@pytest.mark.parametrize("raw", [
    rb'{"messages": [{"role": "user", "content": "\ud83d\ude00 and \\ud800 as text"}]}',   # a pair; "\\" escaped
    '{"messages": [{"role": "user", "content": "caf\u00e9 \u4e2d"}]}'.encode(),
])
def test_valid_text_is_untouched(raw):
    assert jsontext.fault(raw) is None
    parse(raw, ChatRequest)


@pytest.mark.parametrize(("raw", "offset", "path"), [
    (b'{"a": 1, "b": "xyz"}', 16, "b"),
    (b'{"a": [1, {"c": "xyz"}]}', 17, "a[1].c"),
    (b'{"a": {"k": "v"}, "b": "w"}', 24, "b"),
    (b'["x", "y\\"z"]', 10, "[1]"),
    (b'{"a": 1}', 0, None),
])
def test_path_at(raw, offset, path):
    assert jsontext.path_at(raw, offset) == path
