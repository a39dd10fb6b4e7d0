"""Incremental tokenization: a rendered prompt is cut at its special tokens and each piece is encoded once.

A fast tokenizer splits its input at added tokens that are matched on the raw text (`normalized: false`, no
lstrip/rstrip/single-word) *before* normalizing, pre-tokenizing and running the model, and it processes the
pieces between them independently. So for such a token set,

    encode(p0 + S1 + p1 + S2 + p2) == encode(p0) + [id(S1)] + encode(p1) + [id(S2)] + encode(p2)

and a chat template that wraps every message in special tokens (ChatML, Llama 3, DeepSeek, ...) turns a
conversation into pieces that repeat, unchanged, turn after turn: only the new ones need the tokenizer.
Whether the equation holds for a given tokenizer is *checked*, not assumed (`PieceEncoder.verify`, run at
start-up on probe texts; some pre-tokenizers treat the first piece of a text differently): when it does not,
the renderer encodes the whole text every time. This module knows nothing of transformers: it is given the
tokenizer's batch encode function and its special tokens.
"""

from __future__ import annotations

import re
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence

import msgspec

DEFAULT_CACHE_TOKENS = 4_000_000       # token ids kept (about 4 bytes each as array('i'), plus the text)
MAX_JOINED_CHUNKS = 512                 # pieces a joined TokenIds keeps before it merges them

_encode_json = msgspec.json.Encoder().encode
EncodeBatch = Callable[[list[str]], list[list[int]]]
Piece = tuple[tuple[int, ...], bytes, bytes]   # a piece's ids, as int64 bytes, as JSON array items (no brackets)
_NOTHING: Piece = ((), b"", b"")


def piece(ids: Sequence[int]) -> Piece:
    """Token ids in the three forms a prompt is joined from."""
    return tuple(ids), array("q", ids).tobytes(), ",".join(map(str, ids)).encode()

# Text a probe wraps around special tokens: spaces, newlines, digits, punctuation and non-ASCII at the edges.
PROBE_PIECES = ("", "user\nHello world", " leading space", "trailing space ", "\n\n", "\n", "  two  spaces",
                "ünïcödé — 中文 🙂", "1234567 89", "assistant\n", "a", "!?", "\tx\ty", "system\nYou are kind.")


class TokenIds(list):
    """A list of token ids that also carries them as int64 little-endian bytes (what continuity hashes) and as
    a JSON array (what both legs send). Built from cached pieces (`of_pieces`), each is a join of the pieces'
    own, made when first asked for: a prompt that is encoded and then replaced (by its "generated" form,
    generated.py) never pays for them. Slices and sums are plain lists."""

    __slots__ = ("_bytes", "_json", "_byte_chunks", "_json_items")

    def __init__(self, ids: Sequence[int] = (), as_bytes: bytes | None = None) -> None:
        super().__init__(ids)
        self._bytes, self._json = as_bytes, None
        self._byte_chunks: list[bytes] | None = None
        self._json_items: list[bytes] | None = None

    @classmethod
    def of_pieces(cls, ids: TokenIds, byte_chunks: list[bytes], json_items: list[bytes]) -> TokenIds:
        """`ids` (made with `TokenIds.__new__`, filled in place) with its pieces' bytes and JSON array items."""
        ids._bytes = ids._json = None
        ids._byte_chunks, ids._json_items = byte_chunks, json_items
        return ids

    @classmethod
    def joined(cls, parts: Sequence[Sequence[int]]) -> TokenIds:
        """The ids of `parts` one after the other, their bytes and JSON kept as the parts' pieces (a
        continued prompt copies the previous ids' references, never re-encodes them)."""
        ids = cls.__new__(cls)
        chunks: list[bytes] = []
        items: list[bytes] = []
        for part in parts:
            ids += part
            if isinstance(part, TokenIds):
                chunks += part._byte_chunks if part._byte_chunks is not None else [part.as_bytes]
                items += part._json_items if part._json_items is not None else [part.as_json[1:-1]]
            elif part:
                _, as_bytes, as_json = piece(part)
                chunks.append(as_bytes)
                items.append(as_json)
        if len(chunks) > MAX_JOINED_CHUNKS:           # a long chain of turns: one chunk now and then
            chunks, items = [b"".join(chunks)], [b",".join(i for i in items if i)]
        return cls.of_pieces(ids, chunks, [i for i in items if i])

    def extend_pieces(self, other: TokenIds) -> None:
        """`other`'s ids appended in place, its pieces after this one's (`HeldIds.extended`: the chain's own list
        grows by a turn's new tokens, nothing of the history is copied)."""
        self += other
        if self._byte_chunks is None and self._bytes is not None:
            self._byte_chunks = [self._bytes]
        if self._json_items is None and self._json is not None:
            self._json_items = [self._json[1:-1]] if len(self._json) > 2 else []
        self._bytes = self._json = None             # joined again when asked for; None chunks: from the ids
        if self._byte_chunks is not None:
            self._byte_chunks += other._byte_chunks if other._byte_chunks is not None else [other.as_bytes]
        if self._json_items is not None:
            self._json_items += [i for i in (other._json_items if other._json_items is not None
                                             else [other.as_json[1:-1]]) if i]

    @property
    def as_bytes(self) -> bytes:
        if self._bytes is None:
            chunks = self._byte_chunks
            self._bytes = b"".join(chunks) if chunks is not None else array("q", self).tobytes()
        return self._bytes

    @property
    def as_json(self) -> bytes:
        if self._json is None:
            items = self._json_items
            self._json = b"[" + b",".join(items) + b"]" if items is not None else _encode_json(list(self))
        return self._json


class HeldIds:
    """A stored response's token ids: the first `n` of a list that a later turn of its chain may have extended in
    place. The first turn to continue it takes the list as it is (O(new tokens)); a branch from it afterwards,
    seeing the list grown, copies the first `n` (O(history), only for branches)."""

    __slots__ = ("ids", "n")

    def __init__(self, ids: TokenIds, n: int | None = None) -> None:
        self.ids, self.n = ids, len(ids) if n is None else n

    def __len__(self) -> int:
        return self.n

    @property
    def last(self) -> int | None:
        return self.ids[self.n - 1] if self.n else None

    def extended(self, new: TokenIds) -> TokenIds:
        if len(self.ids) == self.n:
            self.ids.extend_pieces(new)
            return self.ids
        prefix = TokenIds(self.ids[:self.n], as_bytes=self.ids.as_bytes[:8 * self.n])
        return TokenIds.joined([prefix, new])

    @property
    def as_bytes(self) -> bytes:
        return self.ids.as_bytes[:8 * self.n] if len(self.ids) != self.n else self.ids.as_bytes


class PieceEncoder:
    """text → token ids via a bounded LRU cache of the pieces between special tokens."""

    def __init__(self, specials: dict[str, int], encode_batch: EncodeBatch,
                 max_tokens: int = DEFAULT_CACHE_TOKENS) -> None:
        if not specials:
            raise ValueError("no special tokens to cut at")
        self._specials = specials
        self._special_pieces = {s: piece([i]) for s, i in specials.items()}
        self.safe = safe_cuts(specials)
        alternatives = "|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True))
        self._split = re.compile(f"({alternatives})").split
        self._encode_batch = encode_batch
        # Per piece: its ids, as int64 bytes, as JSON array items (no brackets). Ids as tuples: a tuple of ints
        # drops out of the garbage collector's view, a list would be re-scanned, millions of elements, on every
        # full collection.
        self._cache: OrderedDict[str, Piece] = OrderedDict()
        self._cached_tokens = 0
        self.max_tokens = max_tokens
        self.hits = self.misses = 0

    def split(self, text: str) -> list[str]:
        """piece, special, piece, special, ..., piece."""
        return self._split(text)

    def encode(self, text: str) -> TokenIds:
        parts = self._split(text)               # piece, special, piece, special, ..., piece
        found = self.lookup(parts[0::2])
        ids = TokenIds.__new__(TokenIds)          # filled in place: no second copy of a long prompt
        chunks: list[bytes] = []
        items: list[bytes] = []
        for i, part in enumerate(parts):
            piece_ids, piece_bytes, piece_json = self.special(part) if i & 1 else found[i >> 1]
            ids += piece_ids
            chunks.append(piece_bytes)
            if piece_json:
                items.append(piece_json)
        return TokenIds.of_pieces(ids, chunks, items)

    def lookup(self, pieces: list[str]) -> list[Piece]:
        """Each piece (text between special tokens) as (ids, int64 bytes, JSON items), encoding in one batch
        those not cached; "" is no tokens. The pieces just looked up are the last to be evicted."""
        cache = self._cache
        missing = [p for p in dict.fromkeys(pieces) if p and p not in cache]
        if missing:
            self._add(missing, self._encode_batch(missing))
        out = []
        for text in pieces:
            if text:
                out.append(cache[text])
                cache.move_to_end(text)
            else:
                out.append(_NOTHING)
        self.misses += len(missing)
        self.hits += sum(1 for p in pieces if p) - len(missing)
        self._evict(keep=len(pieces))
        return out

    def special(self, special: str) -> Piece:
        """A special token as (ids, int64 bytes, JSON items)."""
        return self._special_pieces[special]

    def _add(self, pieces: list[str], encoded: list[list[int]]) -> None:
        for text, piece_ids in zip(pieces, encoded, strict=True):
            self._cache[text] = piece(piece_ids)
            self._cached_tokens += len(piece_ids)

    def _evict(self, keep: int) -> None:
        """Least recently used first, never the `keep` most recent (the request just served)."""
        while self._cached_tokens > self.max_tokens and len(self._cache) > keep:
            _, (old, _, _) = self._cache.popitem(last=False)
            self._cached_tokens -= len(old)

    def verify(self, encode_full: Callable[[str], list[int]], extra_pieces: Sequence[str] = (),
               first: Sequence[str] = (), limit: int = 8) -> str | None:
        """Check the decomposition on probe texts; None when exact, else the first counterexample.
        Probes every special token in `first` (e.g. those the chat template uses) and others up to `limit`."""
        pieces = [*PROBE_PIECES, *extra_pieces]
        chosen = list(dict.fromkeys([s for s in first if s in self._specials] + list(self._specials)))[:limit]
        texts = ["".join(s + p for s, p in zip(list(self._specials) * len(pieces), pieces))]
        for special in chosen:
            texts.append(special.join(pieces))
            texts.append(special + special.join(reversed(pieces)) + special)
            texts += [p + special + q for p, q in zip(pieces, pieces[1:])]
        probe = PieceEncoder(self._specials, self._encode_batch)
        for text in texts:
            probe._cache.clear()
            if list(probe.encode(text)) != list(encode_full(text)):
                return text
        return None

    @property
    def cached_tokens(self) -> int:
        return self._cached_tokens


def safe_cuts(specials: dict[str, int]) -> frozenset[str]:
    """The special tokens a text may be cut right after, and the two sides encoded apart (turns/intake/prompts.py):
    those found in no other special token except at its end. Cutting after S is exact unless the tokenizer's
    scan of the longer text finds a longer token that begins before or at S and runs past the cut, and that
    token would contain S (all of S lies between its start and the cut) other than at its end."""
    if any("\0" in s for s in specials):
        return frozenset()
    joined = "\0".join(specials) + "\0"          # each token ends where a NUL follows
    safe = set()
    for special in specials:
        at = joined.find(special)
        while at >= 0 and joined[at + len(special)] == "\0":
            at = joined.find(special, at + 1)
        if at < 0:
            safe.add(special)
    return frozenset(safe)


def exact_specials(added: dict[int, object]) -> dict[str, int] | None:
    """The added tokens a tokenizer matches on the raw text (what the pieces are cut at), from transformers'
    `added_tokens_decoder` ({id: AddedToken}). None if any such token strips or needs word boundaries
    (then pieces are not independent)."""
    specials: dict[str, int] = {}
    for token_id, token in added.items():
        if getattr(token, "normalized", True):
            continue                    # matched after normalization, inside a piece: the piece's encode sees it
        if getattr(token, "lstrip", False) or getattr(token, "rstrip", False) or getattr(token, "single_word", False):
            return None
        specials[getattr(token, "content", str(token))] = token_id
    return specials or None
