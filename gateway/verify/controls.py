"""Controls driven straight at P and D, without the gateway: KV read rightly and wrongly on purpose, to prove the
measure can tell them apart on this deployment (docs/protocol.md §3-§4).

For each control a first turn runs as the gateway's would (P prefills token ids S0 and holds them, D reads them
and answers; D then pins S = S0 + answer behind its handle), then P is sent a prompt Q with D's handle and a
fresh `cache_salt` (P's own prefix cache must not supply what the handle should):
- `extend` (right KV, must pass): Q extends S. P reads S's KV and computes the rest;
- `handle_longer_than_prompt` (wrong, must be flagged): Q is S's first half with the whole handle: the reader
  keeps the handle's last blocks (tail alignment), the KV of other positions;
- `other_conversation` (wrong, must be flagged): Q is another conversation's tokens, longer than S, with S's
  handle: KV of other tokens.
P's one-token answer to Q is compared with the baseline's on Q. Every D handle obtained is spent by P's read;
one left unspent by a failure is released with a zero-token read through P, so no control leaves D's blocks
pinned. (P's own lease on Q ends with `kv_lease_duration`.)
"""

from __future__ import annotations

import random
import uuid
from dataclasses import dataclass
from typing import Any

from gateway.engines import kv
from gateway.verify import judge
from gateway.verify.http import Wire
from gateway.verify.suite import ANSWER_TOKENS, SEED, TOP_K

KINDS = ("extend", "handle_longer_than_prompt", "other_conversation")
EXTENSION_TOKENS = 96           # more than vLLM's kv_recompute_threshold (64): P really reads


@dataclass(frozen=True)
class Target:
    prefill: str
    decode: str
    baseline: str
    model: str
    vocabulary: list[int]       # token ids ordinary text is made of (read from the baseline's tokenizer)
    history_tokens: int         # S0's length


class Controls:
    def __init__(self, wire: Wire, target: Target) -> None:
        self.wire, self.t = wire, target
        self._rng = random.Random(SEED)
        self.unspent: list[kv.Handle] = []

    async def run(self, kind: str) -> judge.Observation:
        try:
            s, handle = await self._first_turn()
        except ControlError as exc:
            return _failed(kind, str(exc))
        if kind == "extend":
            q = s + self._tokens(EXTENSION_TOKENS)
        elif kind == "handle_longer_than_prompt":
            q = s[: len(s) // 2 + 7]
        else:
            q = self._tokens(len(s) + EXTENSION_TOKENS)
        got = await self._completion(self.t.prefill, q, 1, handle.wire, salt=True)
        if got.status == 200:          # P read it: spent. Otherwise P may not have: `release` frees it
            self.unspent.remove(handle)
        ref = await self._completion(self.t.baseline, q, 1, salt=True)
        again = await self._completion(self.t.baseline, q, 1, salt=True)
        note = f"handle {handle.num_tokens} tokens, prompt {len(q)}; P {self.t.prefill} D {self.t.decode}"
        return judge.Observation(f"control {kind}", _output(got), _output(ref), _output(again),
                                 expect_wrong=kind != "extend", note=note)

    async def release(self) -> int:
        """Zero-token reads through P for the handles a failure left unspent; how many were sent."""
        sent = 0
        for handle in self.unspent:
            body = {"model": self.t.model, "prompt": [self.t.vocabulary[0]], "max_tokens": 1,
                    kv.WIRE_KEY: handle.released().wire}
            await self.wire.post(self.t.prefill, "/v1/completions", body)
            sent += 1
        self.unspent.clear()
        return sent

    async def _first_turn(self) -> tuple[list[int], kv.Handle]:
        s0 = self._tokens(self.t.history_tokens)
        p = await self._completion(self.t.prefill, s0, 1, kv.fresh_prefill())
        p_handle = kv.peek(p.body) if isinstance(p.body, dict) else None
        if p.status != 200 or p_handle is None:
            raise ControlError(f"P answered {p.status} without a handle: {str(p.body)[:160]}")
        d = await self._completion(self.t.decode, s0, ANSWER_TOKENS, p_handle.wire)
        d_handle = kv.peek(d.body) if isinstance(d.body, dict) else None
        if d.status != 200 or d_handle is None:
            raise ControlError(f"D answered {d.status} without a handle (is bidirectional_kv_xfer on?): "
                               f"{str(d.body)[:160]}")
        self.unspent.append(d_handle)
        return s0 + list(d.body["choices"][0].get("token_ids") or []), d_handle

    async def _completion(self, url: str, prompt: list[int], max_tokens: int, params: dict[str, Any] | None = None,
                          *, salt: bool = False) -> Any:
        body: dict[str, Any] = {"model": self.t.model, "prompt": prompt, "max_tokens": max_tokens,
                                "temperature": 0, "logprobs": TOP_K, "return_token_ids": True,
                                "return_tokens_as_token_ids": True}
        if params is not None:
            body[kv.WIRE_KEY] = params
        if salt:
            body["cache_salt"] = uuid.uuid4().hex
        return await self.wire.post(url, "/v1/completions", body)

    def _tokens(self, n: int) -> list[int]:
        return [self._rng.choice(self.t.vocabulary) for _ in range(n)]


class ControlError(Exception):
    """The control could not be set up (an engine refused the first turn)."""


def _output(answer: Any) -> judge.Output:
    if answer.status == 0:
        return judge.Output(0, error=answer.error)
    return judge.from_json(answer.status, answer.body, chat=False)


def _failed(kind: str, why: str) -> judge.Observation:
    """A control that could not be set up: judged as no answer, which proves nothing either way."""
    broken = judge.Output(0, error=why)
    return judge.Observation(f"control {kind}", broken, judge.Output(200), judge.Output(200),
                             expect_wrong=kind != "extend", note=why)
