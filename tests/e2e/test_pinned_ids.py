"""P's prompt echo is dropped only where it proves nothing: a start-up probe shows whether each P uses the pinned
prompt ids (vLLM 0.32+, the simulator by default) or renders the messages itself (older vLLM, the simulator's
`--no-prompt-token-ids`), and it is re-run when a P comes back healthy, perhaps as another engine."""

from __future__ import annotations

import uuid

import httpx
import pytest

from tests.e2e.chat import Chat
from tests.e2e.stack import stack
from tests.servers import start

pytestmark = pytest.mark.integration
ADMIN = {"Authorization": "Bearer admin-secret"}


def pinned_ids(url: str, prefill_url: str) -> bool | None:
    engines = httpx.get(url + "/admin/engines", headers=ADMIN).json()["engines"]
    return next(e for e in engines if e["url"] == prefill_url).get("pinned_ids")


def question(i: int) -> str:
    return f"Round {i}: which three checks matter most before a release, and why?"


def test_a_p_is_proven_at_start_and_re_proven_when_it_comes_back_as_an_older_engine():
    with stack(gateway=["--admin-key", "admin-secret"], sim=["--output-tokens", "80:120"]) as s:
        p = s.prefill[0]
        assert pinned_ids(s.gateway.url, p.url) is True
        chat = Chat(s, uuid.uuid4().hex)
        for i in range(3):                  # reuse turns on a proven P: no echo, still exact
            turn = chat.say(question(i))
            assert turn.text == turn.expected
            assert turn.plan == ("full" if i == 0 else "reuse")
        port = p.port
        p.stop()
        s.wait_until(lambda: s.metric("pdgw_engine_healthy", pool="prefill", engine="prefill-0") == 0)
        old = start(["sim", "--tokenizer", "builtin:demo", "--role", "prefill", "--engine-id", "p0",
                     "--no-prompt-token-ids", "--output-tokens", "80:120"], port=port)
        try:
            s.wait_until(lambda: s.metric("pdgw_engine_healthy", pool="prefill", engine="prefill-0") == 1)
            s.wait_until(lambda: pinned_ids(s.gateway.url, p.url) is False)
            # turns go on through it, their P legs echoing their prompt again
            turn = Chat(s, uuid.uuid4().hex).say(question(9))
            assert turn.text == turn.expected
            assert sum(s.stats(e)["kv_reads_corrupt"] for e in [old, *s.decode, s.baseline]) == 0
        finally:
            old.stop()


def test_ps_that_render_the_messages_are_not_proven():
    with stack(gateway=["--admin-key", "admin-secret"], sim=["--no-prompt-token-ids"]) as s:
        assert pinned_ids(s.gateway.url, s.prefill[0].url) is False
