"""`history_tokens: generated`: past answers go to the engines as the exact ids D generated, not as their text
encoded again. Re-encoding decoded text can give other ids (a model may emit a word as two tokens the
tokenizer would merge); then the prompt no longer extends D's held tokens and reuse is lost from that answer on.

The rendered prompt is cut at the tokenizer's special tokens (as `pieces.py` does). A piece that ends with the
text of an answer D generated (same length, same 128-bit hash) is sent as its leading text, encoded, followed
by D's ids for the answer. Every other piece is encoded as usual. The result is consistent turn after turn: the
previous prompt ended with the same leading text (the template's assistant header), encoded the same way. The
splice itself is `prompts.build` (with `answers` and `spans`): it continues the previous prompt's spliced ids
where that gives the same as splicing from the start; this module says what is spliced.

Answers that called tools are kept under the key of their content and calls as parsed (`tools.calls_key`): the
client sends them back as `tool_calls`, which the template re-renders from parsed JSON, not as D's text. An
assistant message whose content and calls have a kept key is rendered as D's text instead (`substitutions`),
and that text, which spans several pieces (<tool_call> is a token of its own), is sent as D's ids. So is a plain
answer whose text holds a token of its own (a model may emit `<tool_response>` or `<think>` in its text: seen
with the unconstrained model on vLLM): no piece ends with its whole text, so it is spliced as a span too.

Which text belongs to D's ids is what the engine's detokenizer made of them, not a plain decode: vLLM decodes
incrementally and holds text back while it ends inside a UTF-8 character (U+FFFD so far), so an answer whose
last tokens stop mid-character (a length cut, or an end-of-turn token after a byte piece) reaches the client
without that tail, while decoding the ids gives it as U+FFFD. `text_of` accepts that, and nothing else.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gateway.errors import InvalidRequestError
from gateway.store import Answer
from gateway.turns.intake.message_cache import memo
from gateway.turns.intake.prompts import text_hash
from gateway.turns.intake.tools import TOOL_BLOCK, calls_key, parse_generated, same_calls

MAX_ANSWER_TOKENS = 32768        # kept per conversation; older answers fall back to their re-encoded text
REPLACEMENT = "\ufffd"           # what decoding puts for bytes that are not (yet) a whole UTF-8 character


def answer(text: str, ids: list[int]) -> Answer:
    return Answer(len(text), text_hash(text), list(ids))


def text_of(decoded: str, text: str) -> bool:
    """Whether `text`, what the client got, is the engine's text for ids that decode to `decoded`: equal, or
    `decoded` minus a tail of U+FFFD the engine withheld (bytes of characters it never completed). A tail with
    whole characters in it is not accepted (the answer is then re-encoded from its text: safe, no reuse)."""
    tail = decoded[len(text):]
    return decoded.startswith(text) and tail == REPLACEMENT * len(tail)


def remember(answers: list[Answer], new: Answer) -> list[Answer]:
    """The answers to keep after `new`: the most recent ones, within MAX_ANSWER_TOKENS."""
    kept, total = [], len(new.ids)
    for old in reversed(answers):
        total += len(old.ids)
        if total > MAX_ANSWER_TOKENS:
            break
        kept.append(old)
    return [*reversed(kept), new]


# -- answers that called tools --------------------------------------------------------------------------
def tool_answer(ids: list[int], generated: str, content: str, tool_calls: list[dict[str, Any]]) -> Answer | None:
    """D's ids as the answer the client got as `content` + `tool_calls`: only if D's text parses to exactly
    those calls, and the content is its text outside the calls (streamed) or before them (not streamed)."""
    calls = parse_generated(generated)
    if calls is None or not same_calls(calls, tool_calls):
        return None
    outside, before = TOOL_BLOCK.sub("", generated), generated[:generated.find("<tool_call>")]
    if content.strip() not in (outside.strip(), before.strip()):
        return None
    try:
        chars, key = calls_key(content, tool_calls)
    except (InvalidRequestError, KeyError, TypeError):
        return None
    return Answer(chars, key, list(ids))


@dataclass
class Substitutions:
    messages: list[dict[str, Any]]              # the conversation with those assistant messages as D's text
    spans: list[tuple[str, list[int]]]          # (D's text, D's ids), in message order

    def only_difference(self, swapped: str, plain: str) -> bool:
        """Whether `swapped` shows every span's text, in order, and is `plain` with only those places changed
        (whatever the template rendered for the calls there): plain = s0 X1 s1 X2 ... sn, swapped = s0 T1 s1 ...
        Each span's text must show no more often than it is a span: the splice puts D's ids at its first showing,
        and a text the template also writes (an answer that is `<think>` alone, or the end-of-turn token's text)
        would put them in the wrong place."""
        if any(swapped.count(t) != n for t, n in Counter(t for t, _ in self.spans).items()):
            return False
        segments, pos = [], 0
        for generated_text, _ in self.spans:
            at = swapped.find(generated_text, pos)
            if at < 0:
                return False
            segments.append(swapped[pos:at])
            pos = at + len(generated_text)
        last = swapped[pos:]
        if not plain.startswith(segments[0]):
            return False
        pos = len(segments[0])
        for segment in segments[1:]:
            at = plain.find(segment, pos)
            if at < 0:
                return False
            pos = at + len(segment)
        return plain.endswith(last) and len(plain) - len(last) >= pos


def substitutions(messages: list[dict[str, Any]], answers: list[Answer], decode: Callable[[list[int]], str],
                  splits: Callable[[str], bool] = lambda text: False,
                  splits_memo: str | None = None) -> Substitutions | None:
    """Assistant messages whose content and tool calls are a kept answer's, as plain messages with D's text; and
    kept plain answers whose text `splits` into several pieces, as they are, each a span of D's ids.
    `splits_memo`: the name `splits`' answer is kept under with each message (one per tokenizer: it depends on
    its special tokens), so a turn does not cut every past answer again; None: not kept."""
    kept = {(a.chars, a.text_hash): a.ids for a in answers}
    out, spans = [], []
    for i, message in enumerate(messages):
        ids, content = None, message.get("content")
        if message.get("role") == "assistant" and message.get("tool_calls"):
            ids = kept.get(memo(messages, i, "calls_key", lambda: _key(message)))
        elif message.get("role") == "assistant" and isinstance(content, str) and content and (
                splits(content) if splits_memo is None else memo(messages, i, splits_memo, lambda: splits(content))):
            if (ids := kept.get((len(content), text_hash(content)))) is not None:
                out.append(message)
                spans.append((content, ids))
                continue
        if ids is None:
            out.append(message)
            continue
        text = decode(ids)
        out.append({"role": "assistant", "content": text})
        spans.append((text, ids))
    return Substitutions(out, spans) if spans else None


def _key(message: dict[str, Any]) -> tuple[int, bytes] | None:
    content = message.get("content")
    if isinstance(content, list):
        content = "\n".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    try:
        return calls_key(content if isinstance(content, str) else "", message["tool_calls"])
    except (InvalidRequestError, KeyError, TypeError):
        return None
