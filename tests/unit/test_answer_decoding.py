"""Engine answers that echo the prompt ids: the request's own ids object when the echo is byte-identical,
an ordinary decode otherwise (never a wrong list)."""

from __future__ import annotations

import msgspec
import pytest

from gateway.turns.intake.request import TurnRequest
from gateway.turns.intake.pieces import TokenIds


def _req(ids, endpoint="/v1/chat/completions") -> TurnRequest:
    return TurnRequest(endpoint=endpoint, body={}, model="m", prompt_ids=TokenIds(ids), stream=True,
                       want_token_ids=False, include_usage=False, request_id="r")


def test_identical_echo_is_the_requests_own_ids():
    req = _req([1, 2, 300])
    raw = msgspec.json.encode({"id": "x", "prompt_token_ids": [1, 2, 300], "choices": [{"index": 0}]})
    answer = req.decode_answer(raw)
    assert answer["prompt_token_ids"] is req.prompt_ids and answer["choices"] == [{"index": 0}]


@pytest.mark.parametrize("raw", [
    b'{"prompt_token_ids":[1,2,301],"choices":[]}',                    # other ids
    b'{"prompt_token_ids":[1,2,300,4],"choices":[]}',                  # longer
    b'{"prompt_token_ids": [1, 2, 300],"choices":[]}',                 # other formatting
    b'{"choices":[{"prompt_token_ids":[1,2,300]}],"prompt_token_ids":null}',   # nested
    b'{"a":{"prompt_token_ids":[1,2,300]},"prompt_token_ids":[9]}',   # nested first, top level differs
    b'{"choices":[{"delta":{"content":"\\"prompt_token_ids\\":[1,2,300]"}}]}',  # inside a string
])
def test_anything_else_decodes_as_it_is(raw):
    assert _req([1, 2, 300]).decode_answer(raw) == msgspec.json.decode(raw)


def test_completions_are_decoded_plainly():
    raw = b'{"choices":[{"prompt_token_ids":[1,2,300]}]}'
    assert _req([1, 2, 300], "/v1/completions").decode_answer(raw) == msgspec.json.decode(raw)
