"""vLLM's KV-handle protocol (NIXL connector, pull mode, bidirectional transfer: docs/protocol.md §2-§4; push
mode, NixlPushConnector: §8).

The only module of the gateway that knows the keys of `kv_transfer_params`. A `Handle` wraps what an engine
returned verbatim, because every field must pass through untouched (vLLM adds fields between versions, e.g.
`remote_prefill_cached_tokens`); it reads the few fields the gateway reasons about, and makes the variants the
legs send: the whole handle, one cut to whole blocks, a zero-token release. Another engine protocol (SGLang's
bootstrap, a vLLM field change) is another module with the same functions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

WIRE_KEY = "kv_transfer_params"     # the request and answer field that carries a handle
_PINNED_IDS = "prompt_token_ids"    # vLLM 0.32+: the prompt ids the engine uses instead of rendering (§5)


class Handle:
    """An engine's handle to KV it holds for a later reader. Immutable: variants are new handles."""

    __slots__ = ("wire",)

    def __init__(self, wire: dict[str, Any]) -> None:
        self.wire = wire

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Handle) and other.wire == self.wire

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Handle(num_tokens={self.num_tokens}, engine={self.wire.get('remote_engine_id')!r})"

    @property
    def num_tokens(self) -> int | None:
        """How many tokens' KV the holder keeps: P's prompt, or D's prompt + output - 1."""
        value = self.wire.get("remote_num_tokens")
        return value if isinstance(value, int) else None

    @property
    def block_groups(self) -> list[list[int]] | None:
        """The holder's block ids, one list per KV-cache group; None when malformed (old flat lists too)."""
        groups = self.wire.get("remote_block_ids")
        if isinstance(groups, list) and groups and all(isinstance(g, list) for g in groups):
            return groups
        return None

    @property
    def producer_cached_tokens(self) -> int | None:
        """P's own prefix-cache hits for the prompt it prefilled, when P reports them in its handle (vLLM >= 0.31)."""
        value = self.wire.get("remote_prefill_cached_tokens")
        return value if isinstance(value, int) and value >= 0 else None

    @property
    def single_group(self) -> bool:
        """Cutting a handle is exact only for one KV-cache group of full attention (§4)."""
        groups = self.block_groups
        return groups is not None and len(groups) == 1

    def cut(self, tokens: int, block_size: int) -> Handle:
        """The same KV, naming only its first `tokens` (a whole number of blocks)."""
        blocks = tokens // block_size
        return Handle({**self.wire, "remote_num_tokens": tokens,
                       "remote_block_ids": [group[:blocks] for group in self.wire["remote_block_ids"]]})

    @property
    def leased(self) -> bool:
        """A handle in a producer's form (`do_remote_prefill`): held for the holder's `kv_lease_duration`, not its
        decoder TTL, and with no expiry in it. D returns one for a request it was asked to hold for a remote
        reader (the local path, §9); nothing renews it, and P never declines a late read of it (it cannot
        tell): a read after the lease reads freed blocks. Read before `as_holders`, which rewrites the flags."""
        return bool(self.wire.get("do_remote_prefill"))

    def as_holders(self) -> Handle:
        """The handle as P must be sent it to read the holder's KV: D's own flags. One D returned for the local
        path carries a producer's (`do_remote_prefill`), with which P loads the whole new prompt, past what D
        holds: silently wrong positions (§9, seen)."""
        if not self.wire.get("do_remote_prefill"):
            return self
        return Handle({**self.wire, "do_remote_decode": True, "do_remote_prefill": False})

    def released(self) -> Handle:
        """A zero-token read: P only notifies the holder, which frees the pinned blocks (§4)."""
        return Handle({**self.wire, "remote_num_tokens": 0})


def fresh_prefill() -> dict[str, Any]:
    """What P gets on a turn without a handle: "prefill this and hold it for a remote decode" (§3)."""
    return {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None}


def leg_params(handle: Handle | None, pinned_ids: bytes | None = None) -> dict[str, Any]:
    """A leg's `kv_transfer_params`: the handle to read through (or a fresh prefill's), plus the verified
    prompt ids as already-encoded JSON when the engine should use exactly those (§5)."""
    params = dict(handle.wire) if handle is not None else fresh_prefill()
    if pinned_ids is not None:
        params[_PINNED_IDS] = msgspec.Raw(pinned_ids)
    return params


def local_params(pinned_ids: bytes | None = None) -> dict[str, Any]:
    """The holder D on the local path: it computes the prompt itself (its prefix cache holds the verified history)
    and, asked as P is asked on a first turn, holds the result behind a handle for a later reader (§9)."""
    return leg_params(None, pinned_ids)


def cache_params(pinned_ids: bytes | None = None) -> dict[str, Any]:
    """The holder D on the local path, holding nothing after: only the verified ids, no flags, so D returns no
    handle and pins nothing (§9: the params are empty once the ids are popped); its prefix cache keeps the
    blocks until it needs them, and its KV events say when it no longer does (§10)."""
    return {} if pinned_ids is None else {_PINNED_IDS: msgspec.Raw(pinned_ids)}


def decode_params(prefill_handle: Handle | None, pinned_ids: bytes | None = None) -> dict[str, Any]:
    """D's leg reads P's handle; without one (P gave none) D simply prefills itself (§3)."""
    params = dict(prefill_handle.wire) if prefill_handle is not None else {}
    if pinned_ids is not None:
        params[_PINNED_IDS] = msgspec.Raw(pinned_ids)
    return params


@dataclass(frozen=True)
class PushTarget:
    """P as a push-mode D leg names it (§8.2): its engine id, side channel and parallelism, the same values P's
    own handle carries. vLLM reads the first four with `params[...]`; `tp_size` and `pp_size` must be P's real
    ones (D waits for one completion notification per writing P rank)."""
    engine_id: str
    host: str
    port: int
    tp_size: int = 1
    pp_size: int = 1

    @classmethod
    def of(cls, handle: Handle | None) -> PushTarget | None:
        """P's identity from a handle P returned in push mode; None from a pull handle or a malformed one. vLLM
        0.25's push P says no `transfer_mode` (seen on the H200: push_scheduler.py's request_finished returns the
        ids, side channel and tp_size only): a handle that does not say is taken as push, since push mode is
        known from the engines' config at start-up and a pool that mixes modes is refused there."""
        wire = handle.wire if handle is not None else {}
        if wire.get("transfer_mode", "push") != "push":
            return None
        engine, host, port = wire.get("remote_engine_id"), wire.get("remote_host"), wire.get("remote_port")
        tp, pp = wire.get("tp_size", 1), wire.get("pp_size", 1)
        if not (isinstance(engine, str) and isinstance(host, str) and _count(port) and _count(tp) and _count(pp)):
            return None
        return cls(engine, host, port, tp, pp)


def transfer_mode_of(handle: Handle | None) -> str | None:
    """"push" or "pull", as P's handle says (vLLM 0.28+); None when it does not say."""
    mode = handle.wire.get("transfer_mode") if handle is not None else None
    return mode if isinstance(mode, str) else None


def push_decode_params(target: PushTarget | None, pinned_ids: bytes | None = None,
                       p_request_id: str = "") -> dict[str, Any]:
    """D's leg in push mode. With `target`: D allocates the prompt's blocks, registers them with that P and
    waits for P's WRITE (§8.2). `remote_block_ids` is left out (D sets it itself). `remote_request_id` must be
    there (vLLM 0.32 reads it with `params[...]` once D schedules the request, nixl/metadata.py:334: without
    it D's engine core dies, seen); D uses it only to heartbeat P's lease, and P's real id ends in 8 random
    characters nobody knows before P answers, so it is `p_request_id`, P's id without them (`engine_base_id`):
    the heartbeats match nothing and P's lease is not extended. None: D alone, from its own prefix cache (the
    local path): no flags at all, since a push engine treats any request carrying `do_remote_decode` as a P
    whose blocks it leases for a registration that never comes (nixl/push_scheduler.py:233-294)."""
    params: dict[str, Any] = {}
    if target is not None:
        params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": target.engine_id,
                  "remote_host": target.host, "remote_port": target.port, "tp_size": target.tp_size,
                  "pp_size": target.pp_size, "remote_request_id": p_request_id}
    if pinned_ids is not None:
        params[_PINNED_IDS] = msgspec.Raw(pinned_ids)
    return params


def engine_base_id(endpoint: str, x_request_id: str) -> str:
    """An engine's internal request id for `X-Request-Id`, without the `-<8 hex>` each engine appends: what
    vLLM pairs a push pair's legs by (§8.2, `entrypoints/openai/*/serving.py`)."""
    return f"cmpl-{x_request_id}-0" if endpoint == "/v1/completions" else f"chatcmpl-{x_request_id}"


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def pinned_only(ids: list[int]) -> dict[str, Any]:
    """A request's `kv_transfer_params` that only pins its prompt ids: no transfer either way (§5)."""
    return {_PINNED_IDS: ids}


def take(answer: dict[str, Any]) -> Handle | None:
    """Remove the handle from an engine's answer (clients never see it) and return it."""
    wire = answer.pop(WIRE_KEY, None)
    return Handle(wire) if isinstance(wire, dict) and wire else None


def peek(answer: dict[str, Any]) -> Handle | None:
    """The handle an answer carries, left in place."""
    wire = answer.get(WIRE_KEY)
    return Handle(wire) if isinstance(wire, dict) and wire else None


def holds_prompt_and_output(handle: Handle, prompt_tokens: int, output_tokens: int) -> bool:
    """D's handle covers prompt + output - 1 tokens: the last sampled token has no KV (§2)."""
    return handle.num_tokens == prompt_tokens + output_tokens - 1


def stored(handle: Handle | None, findable: bool = False) -> dict[str, Any] | None:
    """The form the conversation store keeps (it never interprets handles). Without a handle, `findable` keeps an
    empty one: nothing is pinned on D, but the store files the record in its prefix index and gives it to one
    claim, as it does a handle, so a turn without a session id still finds a conversation whose history only D's
    prefix cache holds (its KV events or, in push mode, the local bet say whether it still does). It reads back
    as no handle (`from_store`)."""
    if handle is not None:
        return handle.wire
    return {} if findable else None


def from_store(wire: dict[str, Any] | None) -> Handle | None:
    return Handle(wire) if wire else None
