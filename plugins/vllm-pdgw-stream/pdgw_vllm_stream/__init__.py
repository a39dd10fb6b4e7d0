"""vLLM general plugin: streamed chat and completions responses hand back the engine's `kv_transfer_params`.

Upstream vLLM (0.32) puts `kv_transfer_params` only on non-streamed responses, so a gateway that streams the
decode leg never gets D's handle and cannot reuse D's KV on the next turn. With this plugin installed in the
engine's environment, the chunk that carries a `finish_reason` also carries the request's
`kv_transfer_params` (when the engine produced one: a request that finished normally on an engine with a KV
connector). Nothing else in the stream changes; token ids stream as vLLM sends them (`return_token_ids`).

vLLM calls `register()` in each of its processes (`vllm.general_plugins` entry point); it patches the two
stream generators of the OpenAI server once, and does nothing where they cannot be imported.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

log = logging.getLogger(__name__)

# (module, class, method, how to get the RequestOutput from one item of its result generator)
TARGETS: list[tuple[str, str, str, Callable[[Any], Any]]] = [
    ("vllm.entrypoints.openai.chat_completion.serving", "OpenAIServingChat",
     "chat_completion_stream_generator", lambda item: item),
    ("vllm.entrypoints.openai.completion.serving", "OpenAIServingCompletion",
     "completion_stream_generator", lambda item: item[1]),
]
MARK = "_pdgw_stream_handle"


def register() -> None:
    for module_name, class_name, method, output_of in TARGETS:
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError):
            log.warning("pdgw-stream: %s.%s not found; streamed handles stay off there", module_name, class_name)
            continue
        if not getattr(getattr(cls, method), MARK, False):
            setattr(cls, method, _with_handle(getattr(cls, method), output_of))


def _with_handle(generator_method: Callable[..., AsyncIterator[str]], output_of: Callable[[Any], Any]):
    signature = inspect.signature(generator_method)

    @functools.wraps(generator_method)
    def method(*args: Any, **kwargs: Any) -> AsyncIterator[str]:
        bound = signature.bind(*args, **kwargs)
        last = _LastOutput(bound.arguments["result_generator"], output_of)
        bound.arguments["result_generator"] = last.outputs()
        return _stamp_final_chunk(generator_method(*bound.args, **bound.kwargs), last)

    setattr(method, MARK, True)
    return method


class _LastOutput:
    """Passes the engine's outputs through, remembering the latest one."""

    def __init__(self, source: AsyncIterator[Any], output_of: Callable[[Any], Any]) -> None:
        self.source, self.output_of, self.output = source, output_of, None

    async def outputs(self) -> AsyncIterator[Any]:
        async for item in self.source:
            self.output = self.output_of(item)
            yield item

    def handle(self) -> dict[str, Any] | None:
        output = self.output
        if output is None or not getattr(output, "finished", False):
            return None
        return getattr(output, "kv_transfer_params", None)


async def _stamp_final_chunk(frames: AsyncIterator[str], last: _LastOutput) -> AsyncIterator[str]:
    stamped = False
    try:
        async for frame in frames:
            if not stamped and _is_finish_chunk(frame) and (handle := last.handle()) is not None:
                frame = _with_params(frame, handle)
                stamped = True
            yield frame
    finally:
        await frames.aclose()       # a client that went away closes vLLM's generator, which aborts the request


def _is_finish_chunk(frame: str) -> bool:
    return frame.startswith("data: {") and '"finish_reason":' in frame and '"finish_reason":null' not in frame


def _with_params(frame: str, handle: dict[str, Any]) -> str:
    payload = json.loads(frame[len("data: "):])
    payload["kv_transfer_params"] = handle
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"
