"""How a simulated engine ends a request it cannot serve: the errors `engine_core.py` raises and `openai_serving.py` answers."""

from __future__ import annotations


class RequestFailed(Exception):
    """The engine ended the request with an error: HTTP 500 (or an SSE error event once streaming)."""


class KVLoadError(RequestFailed):
    """A KV load failed (or was declined) under `kv_load_failure_policy: fail`."""


class KVLoadParked(Exception):
    """A P's read of D's blocks was declined (expiry margin) under `recompute`: real vLLM 0.32 never schedules
    the request again; it waits until the client goes away (docs/vllm-findings.md)."""


class PushLegError(RequestFailed):
    """A push-mode D leg lacks a field vLLM reads with `params[...]` (nixl/push_scheduler.py:184-187,
    nixl/metadata.py:334): a KeyError in D's scheduler kills vLLM's engine core (seen on vLLM 0.32 CPU, for
    `remote_request_id`; docs/protocol.md §8.2). The sim answers HTTP 500, and so every request after it, and
    /health fails, until /sim/reset."""
