"""Property: whatever a client does to its history, no engine ever uses KV computed for other tokens, and the
gateway reuses whenever the new prompt extends the tokens D holds.

The expected verdict is computed here from the engines' own token ids (return_token_ids), independently of
the gateway's continuity code."""

from __future__ import annotations

import uuid

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.e2e.stack import stack

pytestmark = pytest.mark.integration

WORDS = ["alpha", "kernel", "cache", "block", "stream", "token", "prefix", "engine", "river", "orbit"]
ACTIONS = st.lists(st.sampled_from(["extend", "extend", "edit", "truncate", "regenerate", "drop_answer"]),
                   min_size=2, max_size=5)


@pytest.fixture(scope="module", params=["p_path", "local"])
def pd(request):
    """P reading D's KV, and with the local path on (the holder D computes short suffixes itself)."""
    with stack(sim=["--output-tokens", "70:110"], local=request.param == "local") as s:
        yield s


def apply(action: str, messages: list[dict], data) -> None:
    sentence = " ".join(data.draw(st.lists(st.sampled_from(WORDS), min_size=3, max_size=40)))
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    if action == "edit" and users:
        messages[data.draw(st.sampled_from(users))]["content"] = sentence
    elif action == "truncate" and len(messages) >= 3:
        del messages[data.draw(st.integers(1, len(messages) - 1)):]
    elif action == "regenerate" and messages and messages[-1]["role"] == "assistant":
        messages.pop()
        return
    elif action == "drop_answer" and messages and messages[-1]["role"] == "assistant":
        messages[-1]["content"] = messages[-1]["content"].rsplit(" ", 1)[0]
    if not messages or messages[-1]["role"] != "user":
        messages.append({"role": "user", "content": sentence})


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(actions=ACTIONS, data=st.data())
def test_random_histories_never_read_wrong_kv(pd, actions, data):
    session, messages, held = uuid.uuid4().hex, [], None
    for action in ["extend", *actions]:
        apply(action, messages, data)
        raw = pd.client().chat.completions.with_raw_response.create(
            model="demo", messages=messages, max_tokens=150, extra_headers={"X-Session-Id": session},
            extra_body={"return_token_ids": True})
        out = raw.parse().model_dump()
        prompt, output = out["prompt_token_ids"], out["choices"][0]["token_ids"]
        if held is not None and len(prompt) >= len(held) - 1 and prompt[:len(held) - 1] == held[:-1]:
            assert raw.headers["x-pd-plan"] in ("reuse", "local"), (action, raw.headers["x-pd-reason"])
        expected = pd.baseline_client().chat.completions.create(model="demo", messages=messages, max_tokens=150)
        assert out["choices"][0]["message"]["content"] == expected.choices[0].message.content
        held = prompt + output
        messages.append({"role": "assistant", "content": out["choices"][0]["message"]["content"]})
    assert pd.total("kv_reads_corrupt") == 0
