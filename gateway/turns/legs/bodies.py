"""The legs of a turn as vLLM wants them (docs/protocol.md §3, §8, §9): request bodies, and what P's answer says."""

from __future__ import annotations

from typing import Any

import msgspec

from gateway.engines import kv
from gateway.turns.intake.request import TurnRequest
from gateway.turns.legs.pair import PushPair

# Fields that only make sense on the leg that produces the client's answer.
_DECODE_ONLY = ("stream", "stream_options", "min_tokens", "max_completion_tokens", "logprobs", "top_logprobs")


def prefill_body(req: TurnRequest, handle: kv.Handle | None, *, confirm_ids: bool = True,
                 stub: bool = False) -> dict[str, Any]:
    """P's leg: read D's KV through `handle` (None: a fresh prefill). The history and the ids are msgspec.Raw
    (already-encoded JSON) shared with D's leg. `confirm_ids`: have P echo its prompt ids (checked when P
    reads D's KV; otherwise an echo of the whole prompt, 32k ids for a 32k-token history, would be received
    for nothing). `stub`: P is proven to use the pinned ids (`probe.pinned_ids_proven`): only the last message
    is sent (`_forwarded`)."""
    body = {k: v for k, v in _forwarded(req, stub).items() if k not in _DECODE_ONLY}
    body.update(max_tokens=1, stream=False, return_token_ids=confirm_ids)
    body[kv.WIRE_KEY] = kv.leg_params(handle, _pinned_ids(req))
    return _with_prompt(req, body)


def decode_body(req: TurnRequest, prefill_handle: kv.Handle | None, *, local: bool = False, stub: bool = False,
                hold: bool = True) -> dict[str, Any]:
    """D's leg in pull mode: read P's handle (None: D prefills itself); `local`: D alone computes what its prefix
    cache lacks and holds the result for the next turn's reader. `stub`: D is proven to use the pinned ids: only
    the last message is sent. `hold` false: a local D is asked to keep nothing behind a handle."""
    pinned = _pinned_ids(req)
    if local:
        # Holding nothing, D gets the ids only where it is proven to pop them: before vLLM 0.32 they stay in
        # the params, and a bidirectional D pins any request with params for its TTL (docs/protocol.md §9).
        params = kv.local_params(pinned) if hold else kv.cache_params(pinned if stub else None)
    else:
        params = kv.decode_params(prefill_handle, pinned)
    return _decode_with(req, params, stub)


def push_decode_body(req: TurnRequest, pair: PushPair | None, *, local: bool = False,
                     stub: bool = False) -> dict[str, Any]:
    """D's leg in push mode (docs/protocol.md §8.2): D waits for the WRITE of the pair's P (P's handle is not D's
    business there), or without a pair computes alone and holds nothing."""
    target = pair.target if pair is not None and not local else None
    p_id = kv.engine_base_id(req.endpoint, pair.request_id) if pair is not None else ""
    params = kv.push_decode_params(target, _pinned_ids(req), p_id)
    return _decode_with(req, params or None, stub)   # D alone on completions: no params at all ({} reads as none)


def _decode_with(req: TurnRequest, params: dict[str, Any] | None, stub: bool) -> dict[str, Any]:
    body = dict(_forwarded(req, stub))
    body["return_token_ids"] = True
    if params is not None:
        body[kv.WIRE_KEY] = params
    return _with_prompt(req, body)


def _forwarded(req: TurnRequest, stub: bool) -> dict[str, Any]:
    """The body a leg starts from: the whole history, or for an engine proven to use the pinned ids (chat: the
    ids ride in kv_transfer_params) only the last message, the ids carrying the rest (docs/protocol.md §5.1)."""
    return req.stubbed if stub and _pinned_ids(req) is not None else req.forwarded


def _pinned_ids(req: TurnRequest) -> bytes | None:
    """vLLM 0.32+ chat uses the pinned prompt ids instead of rendering: the verified ids (completions carry
    them as the prompt itself)."""
    return req.prompt_json if req.endpoint == "/v1/chat/completions" else None


def _with_prompt(req: TurnRequest, body: dict[str, Any]) -> dict[str, Any]:
    if req.endpoint == "/v1/completions":
        body["prompt"] = msgspec.Raw(req.prompt_json)
    return body


def prompt_ids_of(response: dict[str, Any]) -> list[int] | None:
    """Chat puts prompt ids at the top level, completions in the choice."""
    ids = response.get("prompt_token_ids")
    if ids is None and response.get("choices"):
        ids = response["choices"][0].get("prompt_token_ids")
    return ids
