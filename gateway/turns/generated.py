"""`history_tokens: generated`: past answers go to the engines as the exact ids D generated, not as their text
encoded again. Re-encoding decoded text can give other ids (a model may emit a word as two tokens the
tokenizer would merge); then the prompt no longer extends D's held tokens and reuse is lost from that answer on.

The rendered prompt is cut at the tokenizer's special tokens (as `pieces.py` does). A piece that ends with the
text of an answer D generated (same length, same 128-bit hash) is sent as its leading text, encoded, followed
by D's ids for the answer. Every other piece is encoded as usual. The result is consistent turn after turn: the
previous prompt ended with the same leading text (the template's assistant header), encoded the same way.

Which text belongs to D's ids is what the engine's detokenizer made of them, not a plain decode: vLLM decodes
incrementally and holds text back while it ends inside a UTF-8 character (U+FFFD so far), so an answer whose
last tokens stop mid-character (a length cut, or an end-of-turn token after a byte piece) reaches the client
without that tail, while decoding the ids gives it as U+FFFD. `text_of` accepts that, and nothing else.
"""

from __future__ import annotations

from hashlib import blake2b

from gateway.store import Answer
from gateway.turns.pieces import PieceEncoder, TokenIds

MAX_ANSWER_TOKENS = 32768        # kept per conversation; older answers fall back to their re-encoded text
REPLACEMENT = "\ufffd"           # what decoding puts for bytes that are not (yet) a whole UTF-8 character


def text_hash(text: str) -> bytes:
    return blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


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


def splice(pieces: PieceEncoder, text: str, answers: list[Answer]) -> TokenIds:
    by_length: dict[int, dict[bytes, list[int]]] = {}
    for a in answers:
        by_length.setdefault(a.chars, {})[a.text_hash] = a.ids
    ids: list[int] = []
    for i, part in enumerate(pieces.split(text)):
        if i & 1:
            ids.append(pieces.special_id(part))
        elif part:
            ids += _generated(pieces, part, by_length) or pieces.encode(part)
    return TokenIds(ids)


def _generated(pieces: PieceEncoder, piece: str, by_length: dict[int, dict[bytes, list[int]]]) -> list[int] | None:
    for chars, known in by_length.items():
        if 0 < chars <= len(piece) and (ids := known.get(text_hash(piece[len(piece) - chars:]))) is not None:
            head = piece[:len(piece) - chars]
            return [*(pieces.encode(head) if head else ()), *ids]
    return None
