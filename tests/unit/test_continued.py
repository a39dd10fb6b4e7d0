"""turns/intake/continued.py: a previous_response_id prompt continued from the previous ids at the template's
boundary equals encoding the whole rendering, for the builtin templates and a DeepSeek one, text answers and
tool results; the boundary probe; api/sessions.py's session ids."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.api.sessions import session_id
from gateway.errors import InvalidRequestError
from gateway.turns.intake.continued import Continuation, boundary
from gateway.turns.intake.intake import Intake
from gateway.turns.intake.render import Renderer

DATA = Path(__file__).resolve().parents[1] / "data"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture(scope="module", params=["builtin:demo", "builtin:demo-reasoning"])
def continuation(request) -> Continuation:
    return Continuation(Intake(Renderer(request.param), ["demo"]))


def whole(c: Continuation, messages, tools=None) -> list[int]:
    return c.intake.renderer.tokenizer.encode(c.render(messages, tools=tools), add_special_tokens=False)


@pytest.mark.parametrize("tools", [None, TOOLS])
@pytest.mark.parametrize("new", [
    [{"role": "user", "content": "And in Zürich? 🙂"}],
    [{"role": "tool", "tool_call_id": "a", "content": '{"temp": 21}'}, {"role": "tool", "tool_call_id": "b",
                                                                          "content": "ok"}],
    [{"role": "system", "content": "Now be terse."}, {"role": "user", "content": "Go."}],
])
def test_continued_ids_equal_the_whole_rendering(continuation, tools, new):
    tok = continuation.intake.renderer.tokenizer
    history = [{"role": "system", "content": "You help."}, {"role": "user", "content": "Weather?"}]
    answer = "It is sunny, 21 degrees."
    prompt = whole(continuation, history, tools)
    output = [*tok.encode(answer, add_special_tokens=False), tok.eos_token_id]
    text = boundary(continuation, new, tok.eos_token_id, {"tools": tools})
    continued = [*prompt, *output, *tok.encode(text, add_special_tokens=False)]
    assert continued == whole(continuation, [*history, {"role": "assistant", "content": answer}, *new], tools)


def test_an_answer_cut_without_its_end_token_gets_the_template_s(continuation):
    tok = continuation.intake.renderer.tokenizer
    new = [{"role": "user", "content": "Go on."}]
    cut = tok.encode("It is sun", add_special_tokens=False)
    text = boundary(continuation, new, cut[-1], {})
    assert text.startswith("<|im_end|>")


def test_the_probe_passes_for_the_builtin_templates(continuation):
    assert continuation.exact


def test_the_probe_refuses_a_template_that_rewrites_past_answers(tmp_path):
    # an assistant message rendered differently once it is not the last one: the boundary is not exact
    template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content if loop.last or m.role != 'assistant' "
                "else 'EARLIER' }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                "{% endif %}")
    path = tmp_path / "t.jinja"
    path.write_text(template)
    assert not Continuation(Intake(Renderer("builtin:demo", str(path)), ["demo"])).exact


def test_a_deepseek_template_probes_as_it_renders():
    path = DATA / "deepseek_chat.jinja"
    if not path.exists():
        pytest.skip("no DeepSeek template in tests/data")
    c = Continuation(Intake(Renderer("builtin:demo", str(path)), ["demo"]))
    assert isinstance(c.exact, bool)                         # whichever: never an exception at start-up


class Headers(dict):
    def get(self, name, default=None):
        return next((v for k, v in self.items() if k.lower() == name.lower()), default)


AGENTS = ["X-Dynamo-Session-Id", "X-Claude-Code-Session-Id", "session_id"]


@pytest.mark.parametrize(("headers", "body", "scope", "want"), [
    ({"X-Session-Id": "s1", "session_id": "c1"}, {}, "head", "s1#"),               # the configured header wins
    ({"X-Session-Id": "s1", "session_id": "c1"}, {}, "exact", "s1"),               # ... as given, if so set
    ({"session_id": "c1"}, {}, "head", "c1#"),                                   # Codex: scoped by its head
    ({"session_id": "c1"}, {}, "exact", "c1#"),                                  # harness ids always scoped
    ({"x-claude-code-session-id": "cc"}, {}, "head", "cc#"),
    ({}, {"conversation_id": "b1"}, "head", "b1#"),
    ({}, {"conversation_id": "b1"}, "exact", "b1"),
    ({}, {}, "head", None),
])
def test_session_ids(headers, body, scope, want):
    got = session_id(Headers(headers), body, "X-Session-Id", AGENTS, b"sys", scope=scope)
    assert got == want if want is None or not want.endswith("#") else got.startswith(want) and len(got) == len(want) + 16


def test_a_plain_session_is_one_conversation_per_head():
    # OpenCode: its title request ("You are a title generator", no tools) on the main loop's X-Session-Id
    headers = Headers({"X-Session-Id": "ses_1"})
    tools = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]
    main = {"messages": [{"role": "system", "content": "You are opencode."}, {"role": "user", "content": "hi"}],
            "tools": tools}
    title = {"messages": [{"role": "system", "content": "You are a title generator."},
                          {"role": "user", "content": "hi"}]}
    same_prompt_no_tools = {"messages": main["messages"]}
    ids = [session_id(headers, body, "X-Session-Id", AGENTS) for body in (main, title, same_prompt_no_tools)]
    assert len(set(ids)) == 3 and all(i.startswith("ses_1#") for i in ids)
    later = {**main, "messages": [*main["messages"], {"role": "assistant", "content": "hello"},
                                  {"role": "user", "content": "go on"}]}
    assert session_id(headers, later, "X-Session-Id", AGENTS) == ids[0]       # the main loop keeps its conversation


def test_a_harness_session_is_one_conversation_per_system_prompt():
    headers = Headers({"X-Claude-Code-Session-Id": "run-1"})
    main = session_id(headers, {}, "X-Session-Id", AGENTS, b"You are Claude Code.")
    side = session_id(headers, {}, "X-Session-Id", AGENTS, b"Write a title.")
    chat = session_id(headers, {"messages": [{"role": "system", "content": "You are Claude Code."}]}, "X-Session-Id",
                      AGENTS)
    assert main != side and main == session_id(headers, {}, "X-Session-Id", AGENTS, b"You are Claude Code.")
    assert chat.startswith("run-1#")


def test_a_session_id_too_long_is_a_400():
    with pytest.raises(InvalidRequestError):
        session_id(Headers({"session_id": "x" * 250}), {}, "X-Session-Id", AGENTS, b"")


def test_held_ids_grow_in_place_once_and_branches_copy():
    from gateway.turns.intake.pieces import HeldIds, TokenIds

    base = TokenIds.joined([TokenIds([1, 2, 3]), [4]])
    held = HeldIds(base)
    first = held.extended(TokenIds([5, 6]))
    assert first is base and list(first) == [1, 2, 3, 4, 5, 6]
    assert first.as_json == b"[1,2,3,4,5,6]" and first.as_bytes == TokenIds([1, 2, 3, 4, 5, 6]).as_bytes
    branch = held.extended(TokenIds([9]))                        # the list grew: a branch copies its first 4
    assert branch is not base and list(branch) == [1, 2, 3, 4, 9] and branch.as_json == b"[1,2,3,4,9]"
    assert list(base) == [1, 2, 3, 4, 5, 6] and (held.last, len(held)) == (4, 4)
    stored = TokenIds([7, 8], as_bytes=TokenIds([7, 8]).as_bytes)         # from the store's bytes: no pieces
    grown = HeldIds(stored).extended(TokenIds([9]))
    assert grown.as_json == b"[7,8,9]" and grown.as_bytes == TokenIds([7, 8, 9]).as_bytes
