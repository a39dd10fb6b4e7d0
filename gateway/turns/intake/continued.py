"""A Responses API turn: a new conversation rendered whole like a chat turn, or one that continues
`previous_response_id` from that response's exact token ids, with no rendering of the history.

A continued turn's prompt is the previous turn's ids as D holds them (its prompt and D's output, as D generated
them) followed by the text the chat template puts after that answer: the answer's end, the new input items, the
generation prompt. That text is what the template renders after the assistant message of a stand-in
conversation, [user, assistant(MARK)] + the new items, less the end-of-turn token D generated itself (the token
a template closes an assistant message with is the one the model stops on). So a turn costs its new items, not
its history: the ids are the previous ones' references (`TokenIds.joined`), the rendering a few messages long.

Where that equals rendering the whole history (the chat path under history_tokens "generated", past answers as
D's ids): wherever the template renders a message the same whatever came before the previous answer, as the
ChatML, Qwen and Llama 3 families do. `verify` checks it at start-up on probe conversations (a text answer
followed by a user message, and by a tool result, with and without tools); tests/e2e/test_responses.py compares
both paths on the simulator, tool calls included. Where the probe differs, every turn is rendered whole from the
stored messages (`Continuation.exact` false): still correct, no longer flat. It cannot hold for templates that
rewrite past answers once a later message exists (reasoning templates drop a past answer's <think> block): the
continued prompt then keeps D's reasoning, which is what D holds, and what OpenAI's Responses API keeps too
across previous_response_id.

Rendered whole as well: a previous response whose ids are unknown (D returned none), and a turn whose
instructions, tools or template kwargs differ from the previous turn's (they head the prompt).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from hashlib import blake2b
from typing import Any

import msgspec

from gateway.errors import InvalidRequestError
from gateway.turns.intake.intake import Intake
from gateway.turns.intake.pieces import HeldIds
from gateway.turns.intake.request import TurnRequest
from gateway.turns.intake.tools import check_chat

MARK = "PDGWANSWER7F3A"                          # the stand-in answer: found once in the rendered text
MAX_PARTS = 64                                   # parts of a conversation's stored messages before they are joined
_STAND_IN = {"role": "user", "content": "PDGWQUESTION"}
_encode = msgspec.json.Encoder().encode
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Previous:
    """A stored response, as the turn that continues it needs it (loaded by turns/state/stored_responses.py)."""
    response_id: str
    session: str
    model: str
    ids: HeldIds | None                   # D's tokens after it: prompt + output; None: unknown
    history: tuple[bytes, ...]            # the conversation so far as chat messages, no instructions: the JSON
                                          # array's items, comma-joined, in parts (one per turn, shared)
    context: bytes                        # `context_of` the turn that made it


@dataclass(frozen=True)
class Thread:
    """What a Responses turn stores after D's answer: its messages before the answer (as `Previous.history`),
    the digest of its other inputs, and whether it was continued from stored ids."""
    history: tuple[bytes, ...]
    context: bytes
    continued: bool


def context_of(instructions: str | None, body: dict[str, Any]) -> bytes:
    """A digest of what heads the prompt besides the messages: the instructions, tools and template kwargs."""
    raw = _encode([instructions, body.get("tools"), body.get("chat_template_kwargs")])
    return blake2b(raw, digest_size=16).digest()


def system_message(instructions: str | None) -> list[dict[str, Any]]:
    return [{"role": "system", "content": instructions}] if instructions else []


class Continuation:
    def __init__(self, intake: Intake) -> None:
        self.intake = intake
        renderer = intake.renderer
        self.exact = renderer.prompts is not None and verify(self)
        if not self.exact:
            log.info("previous_response_id turns are rendered whole: this template's boundary after an answer "
                     "is not exact (or prompts are encoded whole)")

    def turn(self, previous: Previous | None, instructions: str | None, body: dict[str, Any], req: Any,
             request_id: str) -> tuple[TurnRequest, Thread]:
        """`body`: the chat body of the turn (parsed by api/schemas.py): messages are the instructions as a
        system message, if any, then the new input items; tools, sampling, stream; `req` its validated struct."""
        context = context_of(instructions, body)
        head = 1 if instructions else 0
        new = list(body["messages"][head:])
        items = _items(new)
        if previous is None:                             # a new conversation: a chat turn
            return self.intake.chat(body, req, request_id), Thread(_parts(items), context, False)
        history = _parts(*previous.history, items)
        if previous.ids and previous.context == context and self.exact:
            return self._continued(previous, instructions, {**body, "messages": new}, items, req, request_id), \
                Thread(history, context, True)
        earlier = msgspec.json.decode(b"[" + b",".join(previous.history) + b"]")
        whole = {**body, "messages": [*body["messages"][:head], *earlier, *new]}
        return self.intake.chat(whole, req, request_id), Thread(history, context, False)

    def _continued(self, previous: Previous, instructions: str | None, body: dict[str, Any], items: bytes,
                   req: Any, request_id: str) -> TurnRequest:
        intake, messages = self.intake, body["messages"]
        model = intake.model_for(req.model)
        check_chat({**body, "messages": []})            # tools and tool_choice; the calls answered are stored
        _check_results(messages)
        text = boundary(self, messages, previous.ids.last, body)
        intake.context.check_text(text, "input")
        new = intake.renderer.pieces.encode(text)
        wanted = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        intake.context.check_tokens(len(previous.ids) + len(new), wanted, "input")
        ids = previous.ids.extended(new)             # the chain's list grows in place: no copy of the history
        turn = intake._turn("/v1/chat/completions", body, req, model, ids, request_id)
        # The engines still get the whole conversation (for one that renders it itself: P's parity check). As
        # parts: a list of Raw encodes as their texts joined by commas, a JSON array of the messages, copied
        # once when the legs' bodies are encoded, never here.
        head = _encode(system_message(instructions))[1:-1]
        turn.body["messages"] = [msgspec.Raw(part) for part in _parts(head, *previous.history, items)]
        return turn

    def render(self, messages: list[dict[str, Any]], *, tools: Any = None, kwargs: Any = None) -> str:
        return self.intake.renderer.template(messages, tools=tools, add_generation_prompt=True,
                                             chat_template_kwargs=kwargs)


def boundary(continuation: Continuation, new: list[dict[str, Any]], last_id: int | None,
             body: dict[str, Any]) -> str:
    """The template's text after an answer that ended with `last_id`, up to the generation prompt after `new`."""
    text = continuation.render([_STAND_IN, {"role": "assistant", "content": MARK}, *new],
                               tools=body.get("tools"), kwargs=body.get("chat_template_kwargs"))
    at = text.find(MARK)
    after = text[at + len(MARK):]
    renderer = continuation.intake.renderer
    if last_id is not None and last_id in renderer.special_ids:
        end = renderer.tokenizer.convert_ids_to_tokens(last_id)
        if isinstance(end, str) and after.startswith(end):
            after = after[len(end):]                 # D generated the answer's end token itself
    return after


def verify(continuation: Continuation) -> bool:
    """Whether continuing a prompt's ids at the boundary gives what encoding the whole rendering gives, on
    probe conversations (module doc). Run once at start-up."""
    renderer = continuation.intake.renderer
    tool = {"type": "function", "function": {"name": "probe", "parameters": {"type": "object", "properties": {}}}}
    system = {"role": "system", "content": "You are a probe."}
    answer = "Sure, here it is: 42."
    follow_ups = ([{"role": "user", "content": "And then?"}],
                  [{"role": "tool", "tool_call_id": "c1", "content": '{"ok": true}'},
                   {"role": "tool", "tool_call_id": "c2", "content": "two"}])
    eos = renderer.tokenizer.eos_token_id
    try:
        for tools in (None, [tool]):
            for new in follow_ups:
                first = [system, {"role": "user", "content": "Probe me."}]
                whole = _whole(renderer, continuation.render(
                    [*first, {"role": "assistant", "content": answer}, *new], tools=tools))
                prompt = _whole(renderer, continuation.render(first, tools=tools))
                output = [*renderer.tokenizer.encode(answer, add_special_tokens=False), eos]
                text = boundary(continuation, new, eos, {"tools": tools})
                if [*prompt, *output, *_whole(renderer, text)] != whole:
                    return False
    except Exception:  # a template that cannot render the probes: render every turn whole
        log.exception("the previous_response_id boundary probe failed")
        return False
    return True


def _whole(renderer: Any, text: str) -> list[int]:
    return renderer.tokenizer.encode(text, add_special_tokens=False)


def _check_results(messages: list[dict[str, Any]]) -> None:
    for i, message in enumerate(messages):
        if message.get("role") == "tool" and not isinstance(message.get("tool_call_id"), str):
            raise InvalidRequestError("a function_call_output needs its call_id", param=f"input[{i}].call_id")


def _items(messages: list[dict[str, Any]]) -> bytes:
    """The messages' JSON array items, without brackets (their encodings as parsed, when api/schemas.py did)."""
    raw = getattr(messages, "json", None) or _encode(list(messages))
    return raw[1:-1]


def _parts(*parts: bytes) -> tuple[bytes, ...]:
    """Non-empty parts; past MAX_PARTS, joined into one (a long chain copies its history now and then)."""
    kept = tuple(p for p in parts if p)
    return (b",".join(kept),) if len(kept) > MAX_PARTS else kept
