"""Single turns through the gateway with the official openai client: same text as one engine alone, P computed
the prompt, D loaded it, no wrong KV anywhere; bad input and dead engines get OpenAI-shaped errors."""

from __future__ import annotations

import httpx
import pytest

from tests.e2e.stack import stack

pytestmark = pytest.mark.integration

LONG = ("Please explain, step by step and with care, how a paged key value cache lets a serving engine share "
        "prompt prefixes between requests, why blocks are a fixed number of tokens, and what happens when the "
        "cache is full and an old block has to be evicted to make room for a new request arriving now. ")


@pytest.fixture(scope="module")
def pd():
    with stack() as s:
        yield s


def ask(client, content: str, **kw):
    return client.chat.completions.with_raw_response.create(
        model="demo", messages=[{"role": "user", "content": content}], **kw)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_matches_a_single_engine(pd, stream):
    content = f"(stream={stream}) " + LONG
    pd.wait_until(lambda: pd.stats(pd.decode[0])["handles_pinned"] == 0)     # earlier releases are done
    p_before, d_before = pd.stats(pd.prefill[0]), pd.stats(pd.decode[0])
    raw = ask(pd.client(), content, stream=stream, max_tokens=64)
    expected = pd.baseline_client().chat.completions.create(
        model="demo", messages=[{"role": "user", "content": content}], max_tokens=64)
    if stream:
        text = "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)
    else:
        text = raw.parse().choices[0].message.content
    assert text == expected.choices[0].message.content
    assert raw.headers["x-pd-plan"] == "full" and raw.headers["x-pd-reason"] == "no_session"
    prompt = expected.usage.prompt_tokens
    pd.wait_until(lambda: pd.stats(pd.decode[0])["handles_pinned"] == 0)     # this turn's handle released
    p_after, d_after = pd.stats(pd.prefill[0]), pd.stats(pd.decode[0])
    release = 1       # the stateless turn's D handle is released through P with a one-token prompt
    assert p_after["prompt_tokens_computed"] - p_before["prompt_tokens_computed"] == prompt + release
    assert d_after["prompt_tokens_loaded"] - d_before["prompt_tokens_loaded"] == prompt - 1
    assert pd.total("kv_reads_corrupt") == 0


def test_response_hides_engine_internals(pd):
    body = ask(pd.client(), LONG + "internals").parse().model_dump()
    assert "kv_transfer_params" not in str(body) and "prompt_token_ids" not in str(body)
    assert "token_ids" not in body["choices"][0]


def test_token_ids_when_the_client_asks(pd):
    body = ask(pd.client(), LONG + "ids", extra_body={"return_token_ids": True}).parse().model_dump()
    assert body["prompt_token_ids"] and body["choices"][0]["token_ids"]
    assert "kv_transfer_params" not in str(body)


@pytest.mark.parametrize("stream", [False, True])
def test_completions_match_a_single_engine(pd, stream):
    prompt = LONG + f"completion stream={stream}"
    out = pd.client().completions.create(model="demo", prompt=prompt, max_tokens=32, stream=stream)
    text = "".join(c.choices[0].text for c in out if c.choices) if stream else out.choices[0].text
    expected = pd.baseline_client().completions.create(model="demo", prompt=prompt, max_tokens=32)
    assert text == expected.choices[0].text
    assert pd.total("kv_reads_corrupt") == 0


def test_stateless_turns_release_d_handles(pd):
    ask(pd.client(), LONG + "release me")
    pd.wait_until(lambda: pd.stats(pd.decode[0])["handles_pinned"] == 0)


def test_client_kv_transfer_params_are_stripped(pd):
    evil = {"do_remote_prefill": True, "remote_engine_id": "x", "remote_block_ids": [[1, 2, 3]],
            "remote_host": "10.0.0.9", "remote_port": 1, "remote_num_tokens": 48}
    text = ask(pd.client(), LONG + "evil", extra_body={"kv_transfer_params": evil}).parse().choices[0].message.content
    expected = pd.baseline_client().chat.completions.create(
        model="demo", messages=[{"role": "user", "content": LONG + "evil"}])
    assert text == expected.choices[0].message.content
    assert pd.total("kv_reads_corrupt") == 0


@pytest.mark.parametrize(("body", "status", "param"), [
    (b"{broken", 400, None),
    (b'{"model":"demo"}', 400, "messages"),
    (b'{"model":"demo","messages":[{"role":"user","content":"x"}],"n":3}', 400, "n"),
    (b'{"model":"nope","messages":[{"role":"user","content":"x"}]}', 404, "model"),
    (b'{"model":"demo","messages":[{"role":"user","content":5}]}', 400, "messages[0].content"),
])
def test_bad_input_gets_openai_errors(pd, body, status, param):
    resp = httpx.post(pd.gateway.url + "/v1/chat/completions", content=body,
                      headers={"Content-Type": "application/json"})
    assert resp.status_code == status
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param


def test_oversized_body_is_413(pd):
    big = b'{"messages":[{"role":"user","content":"' + b"x" * (9 * 1024 * 1024) + b'"}]}'
    resp = httpx.post(pd.gateway.url + "/v1/chat/completions", content=big,
                      headers={"Content-Type": "application/json"})
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large"


def test_unknown_route_is_openai_shaped(pd):
    resp = httpx.get(pd.gateway.url + "/v1/nothing")
    assert resp.status_code == 404 and "error" in resp.json()


def test_models_and_health(pd):
    assert [m.id for m in pd.client().models.list()] == ["demo"]
    ready = httpx.get(pd.gateway.url + "/ready").json()
    assert ready["ready"] is True
    assert ready["store"] == "embedded"            # as the start-up report, the README and the demo call it


def test_dead_engines_get_503_without_leaking_addresses():
    with stack(gateway=["--prefill", "http://127.0.0.1:9"]) as s:
        s.prefill[0].stop()
        s.wait_until(lambda: httpx.get(s.gateway.url + "/ready").status_code == 503)
        resp = httpx.post(s.gateway.url + "/v1/chat/completions",
                          json={"model": "demo", "messages": [{"role": "user", "content": "hi"}]})
        assert resp.status_code == 503
        assert resp.json()["error"]["code"] == "engine_unavailable"
        assert "127.0.0.1" not in resp.text and "Traceback" not in resp.text
