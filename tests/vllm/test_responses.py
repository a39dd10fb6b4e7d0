"""One Responses API conversation through the gateway on real vLLM P and D (the tier's session gateway): the
openai package's `responses.create` with `previous_response_id`, JSON and streamed turns. Every later turn
continues the stored response's exact ids and P reads D's KV (vLLM's own counters); every answer equals the
co-located baseline's given the whole history as chat messages (vLLM renders them itself), so the continued
prompt is the one rendering the whole history gives."""

from __future__ import annotations

import uuid

import openai
import pytest

from tests.vllm.engines import SERVED_MODEL

pytestmark = pytest.mark.vllm

WORDS = "river stone market signal garden window bridge castle forest ocean valley summer".split()


def test_a_responses_conversation_continues_d_s_kv(engines, gateway):
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    instructions = f"Conversation {uuid.uuid4().hex[:12]}. Answer briefly."
    # Each turn's new text is longer than --local-prefill-max-tokens (256): the P path, where P reads D's KV (a
    # shorter one would go to D alone, the local path, tests/vllm/test_local.py).
    def notes(n: int) -> str:
        return " ".join(WORDS[(i * 7 + n) % len(WORDS)] for i in range(120))   # about 320 tokens of the tiny model

    questions = [f"Here are my notes: {notes(0)}. What do they say?", f"More notes: {notes(1)}. And why?",
                 f"Last notes: {notes(2)}. Tell me one more thing."]
    history = [{"role": "system", "content": instructions}]
    turns, previous = [], None
    for i, question in enumerate(questions):
        loaded_before = engines.prefill.loaded_tokens()
        raw = client.responses.with_raw_response.create(
            model=SERVED_MODEL, instructions=instructions, input=question, previous_response_id=previous,
            max_output_tokens=40, temperature=0, stream=i == 1)
        response = raw.parse() if i != 1 else [e for e in raw.parse()][-1].response
        assert response.status in ("completed", "incomplete") and response.output_text
        turns.append((raw.headers["x-pd-plan"], raw.headers["x-pd-reason"], int(raw.headers["x-pd-reused-tokens"]),
                      int(engines.prefill.loaded_tokens() - loaded_before), response.output_text))
        history += [{"role": "user", "content": question}]
        turns[-1] += (list(history),)
        history += [{"role": "assistant", "content": response.output_text}]
        previous = response.id
    assert turns[0][:2] == ("full", "no_session")      # a new chain without a session id: looked up by prefix
    for plan, reason, reused, loaded, _, _ in turns[1:]:
        assert (plan, reason) == ("reuse", "continuous") and reused > 0
        assert loaded > 0, "P read D's KV"
    for plan, reason, reused, loaded, text, messages in turns:      # after the turns: D's pins are short-lived
        expected = engines.baseline.post("/v1/chat/completions", {
            "model": SERVED_MODEL, "messages": messages, "max_tokens": 40, "temperature": 0,
            "cache_salt": uuid.uuid4().hex}, timeout_s=120)["choices"][0]["message"]["content"]
        assert text == expected, f"turn {len(messages) // 2}: differs from vLLM's rendering of the whole history"
