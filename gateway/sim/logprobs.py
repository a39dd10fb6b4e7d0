"""Log-probabilities of the generated tokens, in vLLM's two shapes (chat's `content` list, completions' parallel
lists), for `logprobs` / `top_logprobs` (vLLM: at most `max_logprobs`, 20 by default).

The simulated model has no logits, so each position's distribution is drawn from the effective context's digest
(what the KV really encodes, see generate.py) and the position: the same context gives the same numbers to the
last bit (a deterministic engine), wrong KV gives another distribution altogether. The generated token is the
most likely one (greedy), as vLLM's answer at temperature 0 is; the others follow at decreasing log-probs.
With `return_tokens_as_token_ids` tokens are named `token_id:N`, as vLLM names them.
"""

from __future__ import annotations

import random
import struct
from collections.abc import Callable
from typing import Any

MAX_LOGPROBS = 20           # vLLM's default --max-logprobs
TOP_CANDIDATES = MAX_LOGPROBS

Decode = Callable[[list[int]], str]


def distribution(digest: bytes, position: int, chosen: int, vocab: int) -> list[tuple[int, float]]:
    """The TOP_CANDIDATES most likely (token, logprob) at `position`, most likely first, `chosen` among them."""
    rng = random.Random(digest + struct.pack("<q", position))
    logprob = -rng.uniform(0.005, 0.7)
    out, seen = [(chosen, logprob)], {chosen}
    while len(out) < min(TOP_CANDIDATES, vocab):
        token = rng.randrange(vocab)
        if token in seen:
            continue
        seen.add(token)
        logprob -= rng.expovariate(2.0) + 1e-4
        out.append((token, logprob))
    return out


def check(logprobs: bool | int | None, top_logprobs: int | None, *, chat: bool) -> int | None:
    """How many alternatives per position the request wants (None: no logprobs); ValueError as vLLM refuses."""
    if chat:
        if top_logprobs is not None and not logprobs:
            raise ValueError("when using `top_logprobs`, `logprobs` must be set to true.")
        wanted = (top_logprobs or 0) if logprobs else None
    else:
        wanted = None if logprobs is None or logprobs is False else int(logprobs)
    if wanted is not None and not 0 <= wanted <= MAX_LOGPROBS:
        raise ValueError(f"Requested sample logprobs of {wanted}, which is greater than max allowed: "
                         f"{MAX_LOGPROBS}")
    return wanted


def _name(token: int, decode: Decode, as_ids: bool) -> str:
    return f"token_id:{token}" if as_ids else decode([token])


def chat(tokens: list[tuple[int, list[tuple[int, float]]]], top: int, decode: Decode, as_ids: bool,
         ) -> dict[str, Any]:
    """`choice.logprobs` of a chat answer (or of one streamed chunk's tokens)."""
    content = []
    for token, dist in tokens:
        name = _name(token, decode, as_ids)
        entry = {"token": name, "logprob": dist[0][1], "bytes": list(name.encode("utf-8", "replace")),
                 "top_logprobs": [{"token": (n := _name(t, decode, as_ids)), "logprob": lp,
                                   "bytes": list(n.encode("utf-8", "replace"))} for t, lp in dist[:top]]}
        content.append(entry)
    return {"content": content}


def completion(tokens: list[tuple[int, list[tuple[int, float]]]], top: int, decode: Decode, as_ids: bool,
               offset: int = 0) -> dict[str, Any]:
    """`choice.logprobs` of a text completion: tokens, their logprobs, each position's top, text offsets."""
    out: dict[str, Any] = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
    for token, dist in tokens:
        out["text_offset"].append(offset)
        out["tokens"].append(_name(token, decode, as_ids))
        out["token_logprobs"].append(dist[0][1])
        out["top_logprobs"].append({_name(t, decode, as_ids): lp for t, lp in dist[:max(top, 1)]})
        offset += len(decode([token]))
    return out
