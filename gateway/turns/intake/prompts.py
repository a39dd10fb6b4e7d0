"""A prompt's token ids continued from an earlier prompt's, instead of encoded again from its start.

A continuous turn's messages are the previous turn's plus new ones, and its rendered text is, up to near the
end of the previous text (the generation prompt), the previous text. `PromptEncoder` keeps, for each prompt
encoded lately, a `Prefix`: its text up to a *cut* and the ids, int64 bytes and JSON of that text, in one
chunk per turn that added to it. The next prompt of the conversation finds it by its messages (`Lineage`: a
key per leading run of messages), checks that its own text starts with that text (a memory compare per
chunk), takes the ids, bytes and JSON as they are and encodes only the text after the cut. Encoding then
costs the new text and copies at memory speed, not a regex scan and a piece lookup per message of the
conversation, nor a tokenizer pass.

Where a cut is exact. Texts are cut at special tokens and the pieces between them encoded apart (pieces.py,
verified at start-up). A cut right after a special token S is exact when the scan of the longer text finds
S there too, which holds unless another special token contains S other than at its end (`safe_cuts`); only
those tokens are cut after. With answers spliced in as D's ids (history_tokens "generated", generated.py),
a cut right after a tool-call answer spliced as D's ids is exact too: the splice begins a new segment there.
Every chunk ends at such a cut, so a prompt whose text agrees with a plain prefix only so far (an edited
message, a template that re-renders a past answer) continues from the last chunk it agrees with.

Answers. What a piece becomes depends on the answers too (a piece that ends with an answer's text is sent
as D's ids for it), so a prefix is continued only where no answer it was not spliced with ends one of its
pieces, and a prefix spliced with answers only if those are the first of the current ones, unchanged, and
its tool-call spans the first of the current ones, with the next one first found after its cut (where
splicing from the start finds it). Otherwise the prompt is encoded from its start: the result is always what
encoding the whole text gives (tests/unit/test_prompt_continuation.py).
"""

from __future__ import annotations

import sys
from array import array
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from hashlib import blake2b

from gateway.store import Answer
from gateway.turns.intake.pieces import PieceEncoder, TokenIds, piece

DEFAULT_PREFIX_BYTES = 256 * 1024 * 1024
MAX_CHUNKS = 16                  # a prefix with more chunks is merged into one (a copy every MAX_CHUNKS turns)
MAX_KEYS = 64                    # keys a conversation's prefix is found by: its latest turns'
Span = tuple[str, list[int]]     # a tool-call answer spliced as D's ids: (D's text, D's ids)


def text_hash(text: str) -> bytes:
    return blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


class Lineage:
    """Which earlier prompts a prompt may continue: one key per leading run of its messages (with the other
    inputs of the template: tools, kwargs), the whole conversation's last. Keys only pick a candidate; every
    candidate's text is compared before use, so a key collision costs an encoding, never a wrong id."""

    __slots__ = ("keys",)

    def __init__(self, message_keys: Sequence[Hashable], inputs: Hashable = None) -> None:
        keys, key = [], hash(inputs)
        for message in message_keys:
            key = hash((key, message))
            keys.append(key)
        self.keys = keys


@dataclass(frozen=True, slots=True, eq=False)
class Prefix:
    """A prompt's text up to a cut, and its ids, in chunks: a turn copies what it adds, not the conversation."""
    texts: tuple[str, ...]
    ids: tuple[tuple[int, ...], ...]
    as_bytes: tuple[bytes, ...]             # the ids as int64 little-endian
    as_json: tuple[bytes, ...]              # the ids as JSON array items, without brackets
    ends: tuple[array, ...]                 # start, end of each piece (an answer's text may end one)
    chars: int
    answers: tuple[Answer, ...] = ()        # what it was spliced with (their order decides which one a piece takes)
    spans: tuple[Span, ...] = ()
    segment: int = 0                        # where the text after the last span begins

    @property
    def size(self) -> int:
        """Bytes held, about: the answers' ids are counted as their own (they come from the store)."""
        return sum(map(sys.getsizeof, self.texts)) + sum(8 * len(c) + 64 for c in self.ids) \
            + sum(map(len, self.as_bytes)) + sum(map(len, self.as_json)) + sum(8 * len(e) for e in self.ends) \
            + sum(40 * len(a.ids) + 100 for a in self.answers)

    def first(self, n: int) -> Prefix:
        """Its first n chunks (a plain prefix only: a spliced one's state holds at its end)."""
        return Prefix(self.texts[:n], self.ids[:n], self.as_bytes[:n], self.as_json[:n], self.ends[:n],
                      sum(map(len, self.texts[:n])))


_EMPTY = Prefix((), (), (), (), (), 0)


class _Slot:
    """One conversation's latest prefix, and the keys (one per turn) it is found by."""
    __slots__ = ("prefix", "size", "keys")

    def __init__(self) -> None:
        self.prefix, self.size, self.keys = _EMPTY, 0, []


class PromptPrefixes:
    """Prefixes by key. A prefix that continues all of another replaces it, under the keys of both: a later
    turn of the conversation finds it by its messages, and so does one that edits the last of them (whose
    prefix then continues from the chunks the texts share, and is kept apart: a branch). Least recently used
    conversations out first beyond `max_bytes` (`Prefix.size`); at most MAX_KEYS keys per conversation."""

    def __init__(self, max_bytes: int = DEFAULT_PREFIX_BYTES) -> None:
        self.max_bytes = max_bytes
        self._by_key: dict[Hashable, _Slot] = {}
        self._slots: OrderedDict[int, _Slot] = OrderedDict()      # by id, least recently used first
        self._bytes = 0

    def find(self, keys: Sequence[Hashable]) -> tuple[_Slot, Prefix] | None:
        """The prefix found under the last key that has one (the longest run of messages)."""
        for key in reversed(keys):
            slot = self._by_key.get(key)
            if slot is not None:
                self._slots.move_to_end(id(slot))
                return slot, slot.prefix
        return None

    def put(self, key: Hashable, prefix: Prefix, slot: _Slot | None = None) -> None:
        """`prefix`, found by `key` from now on; `slot`: the conversation's, whose prefix it continues."""
        if slot is None or id(slot) not in self._slots:
            slot = _Slot()
            self._slots[id(slot)] = slot
        size = prefix.size
        self._bytes += size - slot.size
        slot.prefix, slot.size = prefix, size
        if self._by_key.get(key) is not slot:
            if (other := self._by_key.get(key)) is not None:
                other.keys.remove(key)
            self._by_key[key] = slot
            slot.keys.append(key)
            if len(slot.keys) > MAX_KEYS:
                del self._by_key[slot.keys.pop(0)]
        self._slots.move_to_end(id(slot))
        while self._bytes > self.max_bytes and self._slots:
            _, old = self._slots.popitem(last=False)
            self._bytes -= old.size
            for k in old.keys:
                if self._by_key.get(k) is old:
                    del self._by_key[k]

    @property
    def bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._slots)


class PromptEncoder:
    """Rendered prompt text → ids: continued from a kept prefix where exact, else encoded from the start."""

    def __init__(self, pieces: PieceEncoder, max_bytes: int = DEFAULT_PREFIX_BYTES) -> None:
        self.pieces = pieces
        self.prefixes = PromptPrefixes(max_bytes)
        self.continued = self.started = 0

    def encode(self, text: str, lineage: Lineage | None = None, answers: Sequence[Answer] = (),
               spans: Sequence[Span] = ()) -> TokenIds:
        """`answers`: past answers, sent as D's ids where a piece ends with one's text; `spans`: (D's text, D's
        ids) of tool-call answers, in order, each sent as its ids where it is next found (generated.py); none:
        the plain encoding. A spliced prompt continues the conversation's last spliced one, else its last plain
        one (the first turn with answers)."""
        spliced = bool(answers or spans)
        base, kept, own = None, None, None
        for variant in ((True, False) if spliced else (False,)) if lineage is not None else ():
            found = self.prefixes.find([(variant, key) for key in lineage.keys])
            if found is None or (base := continuation(found[1], text, answers, spans)) is None:
                continue
            kept = found[1]
            if variant == spliced and base is kept:
                own = found[0]          # this conversation's: the new prefix replaces it (else: a branch)
            break
        self.continued += base is not None
        self.started += base is None
        ids, prefix = build(self.pieces, text, answers, spans, base)
        if lineage is not None and prefix is not None and prefix is not kept:
            self.prefixes.put((spliced, lineage.keys[-1]), prefix, own)
        return ids


def continuation(base: Prefix, text: str, answers: Sequence[Answer], spans: Sequence[Span]) -> Prefix | None:
    """The part of `base` from which encoding `text` on gives what encoding it from its start gives (module
    doc): all of a spliced prefix or none; as many whole chunks of a plain one as hold."""
    if base.answers or base.spans:
        return base if _continues(base, text, answers, spans) else None
    limit = min(len(text), _first_ended(base, text, answers))   # the cut may not lie past a piece an answer ends
    if spans:                               # nor past where splicing from the start finds the first span
        limit = min(limit, text.find(spans[0][0]))
    pos, n = 0, 0
    for chunk in base.texts:
        if pos + len(chunk) > limit or not text.startswith(chunk, pos):
            break
        pos, n = pos + len(chunk), n + 1
    return base if n == len(base.texts) else base.first(n) if n else None


def _continues(base: Prefix, text: str, answers: Sequence[Answer], spans: Sequence[Span]) -> bool:
    if len(text) < base.chars or any(not text.startswith(c, p) for c, p in zip(base.texts, _starts(base))):
        return False
    n = len(base.answers)
    if n > len(answers) or any(a != b for a, b in zip(base.answers, answers)):
        return False
    k = len(base.spans)
    if k > len(spans) or any(a != tuple(b) for a, b in zip(base.spans, spans)):
        return False
    if k < len(spans) and text.find(spans[k][0], base.segment) < base.chars:
        return False                              # splicing from the start would find the next span earlier
    return _first_ended(base, text, answers[n:]) >= base.chars


def _starts(base: Prefix) -> list[int]:
    out, pos = [], 0
    for chunk in base.texts:
        out.append(pos)
        pos += len(chunk)
    return out


def _first_ended(base: Prefix, text: str, answers: Sequence[Answer]) -> int:
    """Where the first of the base's pieces that ends with one of the answers' texts begins (else past the
    base's end): a tail hash per piece and answer length, as splicing itself looks them up."""
    by_length: dict[int, set[bytes]] = {}
    for a in answers:
        by_length.setdefault(a.chars, set()).add(a.text_hash)
    if not by_length:
        return base.chars + 1
    for ends in base.ends:
        for i in range(0, len(ends), 2):
            start, end = ends[i], ends[i + 1]
            for chars, digests in by_length.items():
                if 0 < chars <= end - start and text_hash(text[end - chars:end]) in digests:
                    return start
    return base.chars + 1


def build(pieces: PieceEncoder, text: str, answers: Sequence[Answer] = (), spans: Sequence[Span] = (),
          base: Prefix | None = None) -> tuple[TokenIds, Prefix | None]:
    """The ids of `text` (with `answers` and `spans` spliced in as D's ids, see generated.py), from `base` on
    when given (`continuation` said so), and the prefix of them to keep: up to the last exact cut."""
    out = _Builder(pieces, answers, base or _EMPTY)
    pos = out.start
    for span_text, span_ids in spans[len(out.spans):]:
        at = text.index(span_text, pos)
        out.segment(text, pos, at)
        out.span(span_text, span_ids, at + len(span_text))
        pos = at + len(span_text)
    out.segment(text, pos, len(text))
    return out.result(text)


class _Builder:
    """Units of a prompt in text order (pieces, special tokens, spans), and where its last cut is."""

    def __init__(self, pieces: PieceEncoder, answers: Sequence[Answer], base: Prefix) -> None:
        self.pieces, self.answers, self.base = pieces, tuple(answers), base
        self.by_length: dict[int, dict[bytes, list[int]]] = {}
        for a in answers:
            self.by_length.setdefault(a.chars, {})[a.text_hash] = a.ids
        self.ids = TokenIds.__new__(TokenIds)       # filled in place: no second copy of a long prompt
        for chunk in base.ids:
            self.ids += chunk
        self.chunks, self.items = list(base.as_bytes), [j for j in base.as_json if j]
        self.ends = array("q")                      # the new chunk's
        self.spans = list(base.spans)
        self.start, self.segment_start = base.chars, base.segment
        self.first = (len(self.ids), len(self.chunks), len(self.items))
        self.cut: tuple[int, int, int, int, int, int, int] | None = None

    def _add(self, ids: Sequence[int], as_bytes: bytes, as_json: bytes) -> None:
        self.ids += ids
        self.chunks.append(as_bytes)
        if as_json:
            self.items.append(as_json)

    def _mark(self, pos: int) -> None:
        """A cut: text, ids, bytes chunks, JSON chunks, piece ends, spans, segment start."""
        self.cut = (pos, len(self.ids), len(self.chunks), len(self.items), len(self.ends), len(self.spans),
                    self.segment_start)

    def segment(self, text: str, start: int, end: int) -> None:
        """Pieces and special tokens of text[start:end]: a piece that ends with an answer's text is its head,
        encoded, then D's ids for the answer (generated.py); the others are encoded as they are."""
        if start >= end:
            return
        parts = self.pieces.split(text[start:end])
        spliced = [self._generated(p) if p and self.by_length else None for p in parts[0::2]]
        found = self.pieces.lookup([s[0] if s else p for p, s in zip(parts[0::2], spliced)])
        safe, pos = self.pieces.safe, start
        for i, part in enumerate(parts):
            if i & 1:
                self._add(*self.pieces.special(part))
                pos += len(part)
                if part in safe:
                    self._mark(pos)
                continue
            self._add(*found[i >> 1])
            if (answer := spliced[i >> 1]) is not None:
                self._add(*piece(answer[1]))
            if part:
                self.ends.extend((pos, pos + len(part)))
            pos += len(part)

    def span(self, span_text: str, span_ids: list[int], end: int) -> None:
        self._add(*piece(span_ids))
        self.spans.append((span_text, span_ids))
        self.segment_start = end
        self._mark(end)

    def _generated(self, part: str) -> tuple[str, list[int]] | None:
        for chars, known in self.by_length.items():
            if 0 < chars <= len(part) and (ids := known.get(text_hash(part[len(part) - chars:]))) is not None:
                return part[:len(part) - chars], ids
        return None

    def result(self, text: str) -> tuple[TokenIds, Prefix | None]:
        ids = TokenIds.of_pieces(self.ids, self.chunks, self.items)
        if self.cut is None:
            return ids, (self.base if self.base.texts else None)
        pos, n, n_bytes, n_json, n_ends, n_spans, segment = self.cut
        first_ids, first_bytes, first_json = self.first
        old = self.base
        texts = (*old.texts, text[self.start:pos])
        id_chunks = (*old.ids, tuple(ids[first_ids:n]))
        byte_chunks = (*old.as_bytes, b"".join(self.chunks[first_bytes:n_bytes]))
        json_chunks = (*old.as_json, b",".join(self.items[first_json:n_json]))
        ends = (*old.ends, self.ends[:n_ends])
        if len(texts) > MAX_CHUNKS:
            texts, id_chunks = ("".join(texts),), (tuple(ids[:n]),)
            byte_chunks, json_chunks = (b"".join(byte_chunks),), (b",".join(j for j in json_chunks if j),)
            ends = (array("q", b"".join(e.tobytes() for e in ends)),)
        return ids, Prefix(texts, id_chunks, byte_chunks, json_chunks, ends, pos, self.answers,
                           tuple(self.spans[:n_spans]), segment)
