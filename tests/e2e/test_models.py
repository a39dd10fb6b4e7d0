"""Several models behind one gateway (issue 39): a settings file's `models`, each with its own simulated P and D,
tokenizer and chat template (`builtin:demo` and `builtin:demo-reasoning`). Requests are routed by `model` (or an
alias), conversations on both at once reuse their own D's KV and never the other's, a session id used with both is
two conversations, an unknown model is the OpenAI 404, and the simulators' oracle counts 0 corrupt reads."""

from __future__ import annotations

import concurrent.futures
import json
import signal
import threading
import time
import uuid
import urllib.parse
import urllib.request

import openai
import pytest

from tests.e2e.stack import get_json
from tests.servers import labelled_sum, start

ADMIN = "models-admin"
MODELS = {"chat-a": ("builtin:demo", []), "think-b": ("builtin:demo-reasoning", ["--reasoning"])}


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    servers, entries = [], []
    try:
        for name, (tokenizer, extra) in MODELS.items():
            common = ["sim", "--tokenizer", tokenizer, "--model", name, *extra]
            p = start([*common, "--role", "prefill", "--engine-id", f"p-{name}"])
            d = start([*common, "--role", "decode", "--engine-id", f"d-{name}", "--stream-kv-params"])
            servers += [p, d]
            entries.append({"name": name, "aliases": [f"{name}-alias"], "prefill": [p.url], "decode": [d.url],
                            "tokenizer": tokenizer})
        config = tmp_path_factory.mktemp("models") / "gateway.yaml"
        config.write_text(json.dumps({"models": entries}))        # JSON is YAML
        gateway = start(["serve", "--config", str(config), "--health-interval-s", "0.5", "--reuse-policy", "always",
                         "--local-prefill-max-tokens", "0", "--admin-key", ADMIN])
        servers.append(gateway)
        yield gateway, servers[:-1], (config, entries)
    finally:
        for server in reversed(servers):
            server.stop()


def client(gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=30)


SESSION_IDS: dict[str, str] = {}       # session id -> the gateway's id for it (X-PD-Session)


def conversation(gateway, model: str, session: str, turns: int = 3) -> list[str]:
    """A few turns of one conversation; each turn's plan (X-PD-Plan)."""
    messages, plans = [{"role": "user", "content": f"hello {model} {session}, tell me about rivers"}], []
    for turn in range(turns):
        raw = client(gateway).chat.completions.with_raw_response.create(
            model=model, messages=messages, max_tokens=24, extra_headers={"X-Session-Id": session})
        plans.append(raw.headers["X-PD-Plan"])
        SESSION_IDS[session] = raw.headers["X-PD-Session"]
        messages += [{"role": "assistant", "content": raw.parse().choices[0].message.content or ""},
                     {"role": "user", "content": f"and then, part {turn}?"}]
    return plans


def test_models_are_listed_with_their_aliases(two):
    gateway, _, _ = two
    ids = {m.id for m in client(gateway).models.list().data}
    assert ids == {"chat-a", "chat-a-alias", "think-b", "think-b-alias"}


def test_conversations_on_both_models_at_once_reuse_their_own_d(two):
    gateway, engines, _ = two
    jobs = [(model, f"s{i}") for model in ("chat-a", "think-b-alias") for i in range(3)]
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        plans = list(pool.map(lambda job: conversation(gateway, *job), jobs))
    # the reasoning template drops past reasoning from the history: D's KV is reused up to it (partial)
    assert all(p[0] == "full" and set(p[1:]) <= {"reuse", "partial"} for p in plans), plans
    assert all(p[1:] == ["reuse", "reuse"] for (model, _), p in zip(jobs, plans, strict=True) if model == "chat-a")
    stats = {e.args[e.args.index("--engine-id") + 1]: get_json(e.url + "/sim/stats") for e in engines}
    assert sum(s["kv_reads_corrupt"] for s in stats.values()) == 0
    for name in MODELS:         # each model's turns went to its own engines only: 3 conversations x 3 turns
        assert stats[f"d-{name}"]["requests_total"] >= 9
        assert gateway_metric(gateway, "pdgw_turns_total", model=name) >= 9        # counted under its name


def test_a_session_id_used_with_two_models_is_two_conversations(two):
    gateway, engines, _ = two
    assert conversation(gateway, "chat-a", "shared", turns=2) == ["full", "reuse"]
    assert conversation(gateway, "think-b", "shared", turns=2)[0] == "full"      # not chat-a's handle
    stored = {model: admin(gateway, f"/admin/conversations/{named('shared')}?model={model}") for model in MODELS}
    decode = {e.args[e.args.index("--engine-id") + 1]: e.url for e in engines}
    assert {model: c["decode_engine"] for model, c in stored.items()} == \
        {model: decode[f"d-{model}"] for model in MODELS}
    assert all(c["turn"] == 2 for c in stored.values())


def gateway_metric(gateway, name: str, **labels: str) -> float:
    request = urllib.request.Request(gateway.url + "/metrics", headers={"Authorization": f"Bearer {ADMIN}"})
    with urllib.request.urlopen(request, timeout=5) as answer:
        return labelled_sum(answer.read().decode(), name, labels)


def admin(gateway, path: str) -> dict:
    request = urllib.request.Request(gateway.url + path, headers={"Authorization": f"Bearer {ADMIN}"})
    with urllib.request.urlopen(request, timeout=5) as answer:
        return json.loads(answer.read())


def named(session: str) -> str:
    """The conversation's id as the store knows it: the session id scoped by its head (api/sessions.py)."""
    return urllib.parse.quote(SESSION_IDS[session], safe="")


def test_an_unknown_model_is_the_openai_404(two):
    gateway, _, _ = two
    with pytest.raises(openai.NotFoundError) as error:
        client(gateway).chat.completions.create(model="nobody", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=4)
    assert error.value.body["code"] == "model_not_found"


def test_a_reload_changes_one_model_s_engines_and_leaves_the_other_s(two):
    gateway, engines, (config, entries) = two
    extra = start(["sim", "--tokenizer", "builtin:demo", "--model", "chat-a", "--role", "decode",
                   "--engine-id", "d-chat-a-2", "--stream-kv-params"])
    try:
        config.write_text(json.dumps({"models": [{**entries[0], "decode": [*entries[0]["decode"], extra.url]},
                                                 entries[1]]}))
        gateway.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while extra.url not in (seen := {e["url"]: e["model"] for e in admin(gateway, "/admin/engines")["engines"]}):
            assert time.monotonic() < deadline, seen
            time.sleep(0.1)
        assert seen[extra.url] == "chat-a" and sorted(seen.values()).count("think-b") == 2
        assert conversation(gateway, "think-b", "after-reload", turns=2)[0] == "full"        # still served
    finally:
        config.write_text(json.dumps({"models": entries}))
        gateway.proc.send_signal(signal.SIGHUP)
        extra.stop()


def test_a_reload_adds_a_model_and_takes_it_out_again(two):
    """Under load: streamed turns of the models serving on run through both reloads, none fails."""
    gateway, _, (config, entries) = two
    servers = [start(["sim", "--tokenizer", "builtin:demo", "--model", "late-c", "--role", role, "--engine-id",
                      f"{role[0]}-late-c", *(["--stream-kv-params"] if role == "decode" else [])])
               for role in ("prefill", "decode")]
    done, outcomes = threading.Event(), []
    load = [threading.Thread(target=streamed_turns, args=(gateway, model, done, outcomes)) for model in MODELS]
    for thread in load:
        thread.start()
    try:
        late = {"name": "late-c", "prefill": [servers[0].url], "decode": [servers[1].url], "tokenizer": "builtin:demo"}
        config.write_text(json.dumps({"models": [*entries, late]}))
        gateway.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 20
        while "late-c" not in {m.id for m in client(gateway).models.list().data}:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert conversation(gateway, "late-c", "late", turns=2) == ["full", "reuse"]
        assert gateway_metric(gateway, "pdgw_turns_total", model="late-c") == 2
        config.write_text(json.dumps({"models": entries}))
        gateway.proc.send_signal(signal.SIGHUP)
        while "late-c" in {m.id for m in client(gateway).models.list().data}:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        with pytest.raises(openai.NotFoundError):
            conversation(gateway, "late-c", "late", turns=1)
        assert conversation(gateway, "chat-a", "still", turns=2) == ["full", "reuse"]      # the others serve on
        assert servers[1].url not in {e["url"] for e in admin(gateway, "/admin/engines")["engines"]}
        assert gateway_metric(gateway, "pdgw_engine_healthy", engine="late-c.decode-0") == 0     # gone from /metrics
        done.set()
        for thread in load:
            thread.join(timeout=30)
        assert outcomes and all(ok for ok in outcomes), outcomes.count(False)
    finally:
        done.set()
        config.write_text(json.dumps({"models": entries}))
        for server in servers:
            server.stop()


def streamed_turns(gateway, model: str, done: threading.Event, outcomes: list[bool]) -> None:
    """Streamed conversations of two turns on `model` until `done`; each turn's outcome (answered or not)."""
    while not done.is_set():
        session, messages = uuid.uuid4().hex, [{"role": "user", "content": "tell me about rivers"}]
        for _ in range(2):
            try:
                chunks = client(gateway).chat.completions.create(model=model, messages=messages, max_tokens=16,
                                                                 stream=True, extra_headers={"X-Session-Id": session})
                text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                outcomes.append(True)
            except openai.OpenAIError:
                outcomes.append(False)
                break
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "and then?"}]
