"""A turn's prompt continued from the conversation's previous one (turns/intake/prompts.py, turns/intake/message_cache.py) must be
exactly the prompt rendered and encoded whole: for every tokenizer and template the start-up check accepts,
turn after turn, with regenerations, edits and truncations, with tool calls, and with past answers spliced in
as the ids D generated (history_tokens "generated")."""

from __future__ import annotations

import json
import re
from array import array
from collections import Counter
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.api.schemas import MAX_JSON_DEPTH, ChatRequest, parse
from gateway.errors import InvalidRequestError
from gateway.store import Answer
from gateway.turns.intake.generated import answer, remember
from gateway.turns.intake.intake import Intake
from gateway.turns.intake.pieces import PieceEncoder, exact_specials, safe_cuts
from gateway.turns.intake.prompts import Lineage, PromptEncoder, PromptPrefixes, text_hash
from gateway.turns.intake.render import Renderer
from gateway.turns.intake.tools import calls_key, check_chat
from tests.unit.test_render_incremental import TEXT, TOKENIZERS

TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
CASES = {**{name: (make, None) for name, make in TOKENIZERS.items()},
         "demo-tools": (TOKENIZERS["demo"], TOOLS)}


class Stack:
    """One tokenizer and template: the gateway's renderer (prefixes kept, small bounds so that eviction
    happens), the same without prefixes (every prompt encoded from its start), and whole encoding."""

    def __init__(self, name: str) -> None:
        make, self.tools = CASES[name]
        tokenizer, template = make()
        self.incremental = Renderer(tokenizer, template, cache_tokens=3_000, prefix_bytes=200_000)
        self.fresh = Renderer(tokenizer, template, prefix_bytes=0)
        self.whole = Renderer(tokenizer, template, incremental=False)
        assert self.incremental.prompts is not None, "these tokenizers cut exactly at their special tokens"
        self.intake = Intake(self.incremental, ["demo"])
        self.specials = exact_specials(dict(self.whole.tokenizer.added_tokens_decoder))

    def turn(self, messages: list[dict[str, Any]], answers: list[Answer], generation: bool) -> None:
        """The turn as the gateway serves it (parsed, rendered, encoded, re-rendered with D's answers) against
        the same encoded whole: plain = the whole tokenizer's; spliced = the old splice, from the start."""
        body = {"model": "demo", "messages": messages, "add_generation_prompt": generation}
        if self.tools:
            body["tools"] = self.tools
        template = {"tools": self.tools, "add_generation_prompt": generation}
        try:
            check_chat(body)
            expected = self.whole.render_chat(messages, **template)
        except Exception:               # refused (an orphan tool result, a shape the template rejects): so by both
            with pytest.raises(InvalidRequestError):
                self.intake.chat(*parse(msgspec.json.encode(body), ChatRequest), "r")
            return
        turn = self.intake.chat(*parse(msgspec.json.encode(body), ChatRequest), "r")
        assert list(turn.prompt_ids) == list(expected)
        assert turn.prompt_ids.as_json == msgspec.json.encode(list(expected))
        assert turn.prompt_ids.as_bytes == array("q", expected).tobytes()
        if answers:
            spliced = turn.rerender(answers)
            assert list(spliced) == list(self.fresh.render_chat(messages, answers=answers, **template))
            assert spliced.as_json == msgspec.json.encode(list(spliced))


_STACKS: dict[str, Stack] = {}


@pytest.fixture(scope="module", params=sorted(CASES))
def stack(request) -> Stack:
    if request.param not in _STACKS:
        _STACKS[request.param] = Stack(request.param)
    return _STACKS[request.param]


def _calls(n: int, key: str) -> list[dict[str, Any]]:
    return [{"id": f"{key}{i}", "type": "function", "function": {"name": "lookup", "arguments": json.dumps({"q": i})}}
            for i in range(n)]


STEP = st.sampled_from(["user", "assistant", "answer", "tool_round", "system", "regenerate", "edit", "truncate"])


def test_continued_prompts_equal_whole_ones(stack: Stack) -> None:
    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def conversation(data: st.DataObject) -> None:
        converse(stack, data)

    prompts = stack.incremental.prompts
    continued = prompts.continued
    conversation()
    assert prompts.continued > continued              # the runs did continue prompts, not only start them


def converse(stack: Stack, data: st.DataObject) -> None:
    messages: list[dict[str, Any]] = []
    answers: list[Answer] = []
    for turn in range(data.draw(st.integers(1, 7))):
        step = data.draw(STEP)
        text = data.draw(TEXT)
        if step in ("user", "system") or not messages:
            messages.append({"role": "user" if step != "system" else "system", "content": text})
        elif step in ("assistant", "answer"):
            messages.append({"role": "assistant", "content": text})
            if step == "answer" and text:       # D's ids for it, one token per character: not the canonical ones
                ids = [t for ch in text for t in stack.whole.tokenizer.encode(ch, add_special_tokens=False)]
                answers = remember(answers, answer(text, ids))
        elif step == "tool_round" and stack.tools:
            calls = _calls(data.draw(st.integers(1, 2)), f"t{turn}-")
            messages.append({"role": "assistant", "content": text or None, "tool_calls": calls})
            messages += [{"role": "tool", "tool_call_id": c["id"], "content": data.draw(TEXT)} for c in calls]
            generated = "\n".join('<tool_call>\n{"name": "lookup", "arguments": %s}\n</tool_call>'
                                  % c["function"]["arguments"] for c in calls)
            ids = stack.whole.tokenizer.encode(generated, add_special_tokens=False)
            chars, key = calls_key(text or None, calls)
            answers = remember(answers, Answer(chars, key, ids))
        elif step == "edit":
            at = data.draw(st.integers(0, len(messages) - 1))
            messages[at] = {**messages[at], "content": data.draw(TEXT) if messages[at].get("content") is not None
                            else None}
        elif step == "truncate":
            del messages[data.draw(st.integers(1, len(messages))):]
        # "regenerate": the same request again
        stack.turn(messages, answers, data.draw(st.booleans()))


# -- the spliced prompt from its start: the splice as it was, with the whole tokenizer per piece ------------
def old_splice(r: Renderer, text: str, answers: list[Answer], spans=()) -> list[int]:
    specials = exact_specials(dict(r.tokenizer.added_tokens_decoder))
    split = re.compile("(" + "|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True)) + ")").split
    by_length: dict[int, dict[bytes, list[int]]] = {}
    for a in answers:
        by_length.setdefault(a.chars, {})[a.text_hash] = a.ids

    def encode(piece: str) -> list[int]:
        return r.tokenizer.encode(piece, add_special_tokens=False) if piece else []

    def pieces(segment: str) -> list[int]:
        out: list[int] = []
        for i, part in enumerate(split(segment)):
            if i & 1:
                out.append(specials[part])
            elif part:
                for chars, known in by_length.items():
                    if 0 < chars <= len(part) and (ids := known.get(text_hash(part[len(part) - chars:]))) is not None:
                        out += encode(part[:len(part) - chars]) + ids
                        break
                else:
                    out += encode(part)
        return out

    ids, pos = [], 0
    for generated, generated_ids in spans:
        at = text.index(generated, pos)
        ids += pieces(text[pos:at]) + generated_ids
        pos = at + len(generated)
    return ids + pieces(text[pos:])


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(history=st.lists(st.tuples(st.sampled_from(["user", "assistant"]), TEXT), min_size=1, max_size=6),
       split_answers=st.lists(st.booleans(), max_size=6))
def test_splicing_from_the_start_is_the_old_splice(stack: Stack, history, split_answers) -> None:
    messages = [{"role": role, "content": text} for role, text in history]
    answers, ids_by_text = [], {}
    for (role, text), split in zip(history, split_answers):
        if role == "assistant" and text:
            tokens = stack.whole.tokenizer.encode(text, add_special_tokens=False)
            if split:
                tokens = [t for ch in text for t in stack.whole.tokenizer.encode(ch, add_special_tokens=False)]
            answers.append(answer(text, tokens))
            ids_by_text[text] = tokens
    try:
        text = stack.fresh.template(messages, tools=stack.tools)
    except Exception:
        return
    got = stack.fresh.render_chat(messages, answers=answers, rendered=text, tools=stack.tools)
    spans = _spans(stack.whole, text, [m["content"] for m in messages if m["role"] == "assistant"], ids_by_text)
    assert list(got) == old_splice(stack.whole, text, answers, spans)


def _spans(r: Renderer, text: str, contents: list[str], ids_by_text: dict[str, list[int]]) -> list:
    """Answers whose text holds a special token's text are spliced whole (generated.py), where each such text
    shows in the rendering only as often as it is an answer's."""
    specials = exact_specials(dict(r.tokenizer.added_tokens_decoder))
    spans = [(c, ids_by_text[c]) for c in contents if c in ids_by_text and any(s in c for s in specials)]
    if any(text.count(t) != n for t, n in Counter(t for t, _ in spans).items()):
        return []
    return spans


# -- the continuation falls back where it would not be exact ------------------------------------------------
def _encoder(specials: dict[str, int]) -> PieceEncoder:
    return PieceEncoder(specials, lambda texts: [[1000 + ord(c) for c in t] for t in texts])


def test_a_special_token_inside_another_is_never_cut_after() -> None:
    specials = {"<a>": 1, "<a>b": 2, "<c>": 3, "x<c>": 4, "<d>": 5, "<e><d>": 6}
    assert safe_cuts(specials) == {"<a>b", "<c>", "x<c>", "<d>", "<e><d>"}   # inside another only at its end
    prompts = PromptEncoder(_encoder(specials))
    lineage = Lineage([1])
    prompts.encode("hello<a>", lineage)
    continued = prompts.encode("hello<a>bye", Lineage([1, 2]))          # "<a>b" is one token here
    assert list(continued) == list(_encoder(specials).encode("hello<a>bye"))
    assert 2 in continued


def test_a_diverged_history_is_encoded_from_its_start() -> None:
    r = Renderer("builtin:demo")
    first = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    r.encode(r.template(first), Lineage([1, 2]))
    second = [{"role": "system", "content": "be verbose"}, {"role": "user", "content": "hi"},
              {"role": "assistant", "content": "yo"}, {"role": "user", "content": "again"}]
    before = r.prompts.started
    got = r.encode(r.template(second), Lineage([1, 2, 3, 4]))                # keys say "continues": text does not
    assert r.prompts.started == before + 1
    assert list(got) == Renderer("builtin:demo", incremental=False).render_chat(second)


def test_answers_dropped_or_matching_old_pieces_restart_the_splice() -> None:
    r = Renderer("builtin:demo")
    fresh = Renderer("builtin:demo", prefix_bytes=0)
    split = [t for ch in "same words" for t in r.tokenizer.encode(ch, add_special_tokens=False)]
    history = [{"role": "user", "content": "tell me: same words"}, {"role": "assistant", "content": "same words"},
               {"role": "user", "content": "more"}]
    old = answer("older answer", r.tokenizer.encode("older answer", add_special_tokens=False))
    cases = [([old], [old, answer("same words", split)]),      # the new answer ends an earlier piece too
             ([old, answer("same words", split)], [answer("same words", split)])]   # an answer dropped
    for i, (before, after) in enumerate(cases):
        lineage = Lineage([i, 0, 1]), Lineage([i, 0, 1, 2])
        text = r.template(history[:1])
        r.render_chat(history[:1], answers=before, rendered=text, lineage=lineage[0])
        started = r.prompts.started
        got = r.render_chat(history, answers=after, lineage=lineage[1])
        assert r.prompts.started == started + 1
        assert list(got) == list(fresh.render_chat(history, answers=after))


def test_a_template_whose_start_changes_every_turn_is_always_encoded_whole(tmp_path) -> None:
    path = tmp_path / "count.jinja"
    path.write_text("{{ messages | length }}{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>"
                    "{% endfor %}")
    r, whole = Renderer("builtin:demo", str(path)), Renderer("builtin:demo", str(path), incremental=False)
    intake = Intake(r, ["demo"])
    messages = []
    for i in range(5):
        messages.append({"role": "user", "content": f"message {i}"})
        turn = intake.chat(*parse(msgspec.json.encode({"messages": messages}), ChatRequest), "r")
        assert list(turn.prompt_ids) == whole.render_chat(messages)
    assert r.prompts.continued == 0


# -- only what is new is decoded, encoded and hashed ---------------------------------------------------------
def test_a_continuous_turn_touches_only_its_new_messages() -> None:
    r = Renderer("builtin:demo")
    intake = Intake(r, ["demo"])
    system = {"role": "system", "content": "You are kind. " * 3000}
    messages = [system, {"role": "user", "content": "first question"}]
    split_lengths: list[int] = []
    real_split = r.pieces._split
    r.pieces._split = lambda text: (split_lengths.append(len(text)), real_split(text))[1]
    body, req = parse(msgspec.json.encode({"messages": messages}), ChatRequest)
    intake.chat(body, req, "r")
    assert max(split_lengths) > len(system["content"])          # the first turn encodes its history
    for turn in range(3):
        messages += [{"role": "assistant", "content": f"answer {turn}"}, {"role": "user", "content": f"q {turn}"}]
        split_lengths.clear()
        again, req = parse(msgspec.json.encode({"messages": messages}), ChatRequest)
        assert again["messages"][0] is body["messages"][0]      # found by its bytes, not decoded again
        intake.chat(again, req, "r")
        assert max(split_lengths) < 200                        # only the text after the previous prompt


def test_prefixes_are_bounded() -> None:
    prefixes = PromptPrefixes(max_bytes=50_000)
    r = Renderer("builtin:demo")
    r.prompts.prefixes = prefixes
    for i in range(40):
        r.encode(r.template([{"role": "user", "content": f"conversation {i} " * 100}]), Lineage([i]))
        assert prefixes.bytes <= 50_000
    assert 0 < len(prefixes) < 40


# -- a message found by its bytes is still checked in its place ---------------------------------------------
def _chat(messages: list[dict[str, Any]]) -> None:
    Intake(Renderer("builtin:demo"), ["demo"]).chat(*parse(msgspec.json.encode({"messages": messages}),
                                                           ChatRequest), "r")


def test_known_messages_are_checked_in_every_request_and_errors_name_their_place() -> None:
    calls = _calls(1, "k")
    result = {"role": "tool", "tool_call_id": "k0", "content": "42"}
    _chat([{"role": "user", "content": "go"}, {"role": "assistant", "content": None, "tool_calls": calls}, result])
    with pytest.raises(InvalidRequestError) as err:          # the same result, now answering no earlier call
        _chat([{"role": "user", "content": "go"}, result])
    assert err.value.param == "messages[1].tool_call_id"
    bad = {"content": "no role"}
    for messages, where in (([bad], "messages[0].role"), ([{"role": "user", "content": "x"}] * 2 + [bad],
                                                           "messages[2].role")):
        with pytest.raises(InvalidRequestError) as err:
            parse(msgspec.json.encode({"messages": messages}), ChatRequest)
        assert err.value.param == where
    wrong = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": ""}}]}
    for at in (0, 1):
        with pytest.raises(InvalidRequestError) as err:
            _chat([{"role": "user", "content": "x"}] * at + [wrong])
        assert err.value.param == f"messages[{at}].tool_calls[0].function.name"


@pytest.mark.parametrize(("depth", "refused"), [(MAX_JSON_DEPTH - 3, False), (MAX_JSON_DEPTH - 1, True)])
def test_a_message_nesting_too_deep_is_refused_cached_or_not(depth: int, refused: bool) -> None:
    deep = "[" * depth + "]" * depth
    raw = ('{"messages": [{"role": "user", "content": "x", "extra": %s}]}' % deep).encode()
    for _ in range(2):                                   # the second time it would be found by its bytes
        if refused:
            with pytest.raises(InvalidRequestError, match="deeper"):
                parse(raw, ChatRequest)
        else:
            parse(raw, ChatRequest)


def test_a_tool_call_answer_quoted_earlier_restarts_the_splice() -> None:
    """Splicing from the start finds an answer's text at its first place after the previous one: a user who
    quoted it before the cut has it there, so the prompt is not continued past that place."""
    r, fresh = Renderer("builtin:demo"), Renderer("builtin:demo", prefix_bytes=0)
    intake = Intake(r, ["demo"])
    calls = _calls(1, "q")
    generated = '<tool_call>\n{"name": "lookup", "arguments": {"q": 0}}\n</tool_call>'
    ids = [t for ch in generated for t in r.tokenizer.encode(ch, add_special_tokens=False)]   # not canonical
    assert r.decode(ids) == generated
    kept = Answer(*calls_key(None, calls), ids)
    ok = answer("ok", [t for ch in "ok" for t in r.tokenizer.encode(ch, add_special_tokens=False)])
    first = [{"role": "user", "content": f"call it like this: {generated}"}, {"role": "assistant", "content": "ok"},
             {"role": "user", "content": "go on"}]
    body = {"messages": first, "tools": TOOLS}
    intake.chat(*parse(msgspec.json.encode(body), ChatRequest), "r").rerender([ok])   # a spliced prefix is kept
    messages = [*first, {"role": "assistant", "content": None, "tool_calls": calls},
                {"role": "tool", "tool_call_id": "q0", "content": "found"}]
    turn = intake.chat(*parse(msgspec.json.encode({**body, "messages": messages}), ChatRequest), "r")
    spliced = turn.rerender([ok, kept])
    assert list(spliced) == list(fresh.render_chat(messages, tools=TOOLS, answers=[ok, kept]))
    assert list(spliced) != list(fresh.render_chat(messages, tools=TOOLS))      # the ids were spliced in


def test_the_first_turn_with_answers_continues_the_plain_prompt_and_an_edit_the_chunks_before_it() -> None:
    r, whole, fresh = (Renderer("builtin:demo"), Renderer("builtin:demo", incremental=False),
                       Renderer("builtin:demo", prefix_bytes=0))
    intake = Intake(r, ["demo"])
    system = {"role": "system", "content": "You are kind. " * 2000}
    messages, answers = [system, {"role": "user", "content": "first"}], []
    split_lengths: list[int] = []
    real_split = r.pieces._split
    r.pieces._split = lambda text: (split_lengths.append(len(text)), real_split(text))[1]
    for turn in range(4):
        split_lengths.clear()
        request = intake.chat(*parse(msgspec.json.encode({"messages": messages}), ChatRequest), "r")
        if answers:
            assert list(request.rerender(answers)) == list(fresh.render_chat(messages, answers=answers))
        if turn:
            assert max(split_lengths) < 200                 # the spliced prompt too: from the plain one at first
        text = f"answer {turn}"
        ids = [t for ch in text for t in r.tokenizer.encode(ch, add_special_tokens=False)]
        answers = remember(answers, answer(text, ids))
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": f"question {turn}"}]
    messages[3] = {"role": "user", "content": "question 0, edited"}
    split_lengths.clear()
    request = intake.chat(*parse(msgspec.json.encode({"messages": messages}), ChatRequest), "r")
    assert list(request.prompt_ids) == whole.render_chat(messages)
    assert max(split_lengths) < 1000                        # from the chunk before the edit, not the start


def test_known_messages_and_decoded_answers_are_bounded() -> None:
    from gateway.turns.intake.message_cache import MessageCache
    from gateway.turns.intake.render import _Decoded

    cache = MessageCache(max_bytes=20_000)
    for i in range(100):
        parse(msgspec.json.encode({"messages": [{"role": "user", "content": f"message {i} " * 50}]}), ChatRequest,
              cache=cache)
        assert cache.bytes <= 20_000
    assert cache.misses == 100
    decoded = _Decoded(lambda ids: "x" * len(ids), max_tokens=1_000)
    for i in range(100):
        decoded(list(range(i, i + 60)))
        assert decoded._tokens <= 1_000
