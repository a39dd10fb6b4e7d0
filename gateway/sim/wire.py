"""vLLM's OpenAI-compatible JSON, as the simulator reads and writes it.

Requests are msgspec Structs that ignore unknown fields (as vLLM does). Responses are built as plain dicts
because vLLM's shapes depend on which keys are present and which are `null`, and that is easiest to see here.
"""

from __future__ import annotations

import time
from typing import Annotated, Any

import msgspec


# vLLM's protocol models: `seed: int | None = Field(None, ge=_INT64_MIN, le=_INT64_MAX)` (entrypoints/openai/
# chat_completion/protocol.py:238, completion/protocol.py:66): a seed outside int64 is a 400, not a failed request.
Seed = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]


class StreamOptions(msgspec.Struct):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(msgspec.Struct, kw_only=True):
    model: str | None = None
    max_tokens: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: str | list[str] | None = None
    seed: Seed | None = None
    temperature: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = None
    return_token_ids: bool | None = None
    kv_transfer_params: dict[str, Any] | None = None
    request_id: str | None = None
    logprobs: bool | int | None = None          # chat: true/false (with top_logprobs); completions: k
    return_tokens_as_token_ids: bool | None = None
    response_format: Any = None                 # structured output (structured.py)

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class ChatRequest(SamplingFields, kw_only=True):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    top_logprobs: int | None = None


class CompletionRequest(SamplingFields, kw_only=True):
    prompt: str | list[Any]  # text, token ids, or a one-element batch of either


class TokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool | None = None
    return_token_strs: bool = False
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


def error_body(message: str, status: int) -> dict[str, Any]:
    kind = {400: "BadRequestError", 404: "NotFoundError"}.get(status, "InternalServerError")
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens, "prompt_tokens_details": None}


def chat_message(content: str | None, reasoning: str | None,
                 tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"role": "assistant", "content": content, "refusal": None, "annotations": None, "audio": None,
            "function_call": None, "tool_calls": tool_calls or [], "reasoning": reasoning,
            "reasoning_content": reasoning}


def chat_response(rid: str, model: str, *, content: str | None, reasoning: str | None, finish: str,
                  stop_reason: str | int | None, token_ids: list[int] | None, prompt_ids: list[int] | None,
                  n_prompt: int, n_out: int, kv_params: dict[str, Any] | None,
                  tool_calls: list[dict[str, Any]] | None = None,
                  logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "message": chat_message(content, reasoning, tool_calls),
                              "logprobs": logprobs, "finish_reason": finish, "stop_reason": stop_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [choice], "service_tier": None, "system_fingerprint": None,
            "usage": usage(n_prompt, n_out), "prompt_logprobs": None, "prompt_token_ids": prompt_ids,
            "kv_transfer_params": kv_params}


def completion_response(rid: str, model: str, *, text: str, finish: str, stop_reason: str | int | None,
                        token_ids: list[int] | None, prompt_ids: list[int] | None, n_prompt: int, n_out: int,
                        kv_params: dict[str, Any] | None, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish,
                              "stop_reason": stop_reason, "prompt_logprobs": None}
    if token_ids is not None:
        choice["prompt_token_ids"] = prompt_ids
        choice["token_ids"] = token_ids
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [choice], "service_tier": None, "system_fingerprint": None,
            "usage": usage(n_prompt, n_out), "kv_transfer_params": kv_params}


def chunk(rid: str, model: str, created: int, obj: str, choices: list[dict[str, Any]],
          **top: Any) -> dict[str, Any]:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": choices, **top}


def sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else msgspec.json.encode(payload).decode()
    return f"data: {data}\n\n".encode()
