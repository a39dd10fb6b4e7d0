"""Policy `buffer`: the client asked for a stream but D's handle only comes with a non-streamed answer, so the
whole answer is fetched first and then sent as OpenAI-shaped SSE chunks."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

import msgspec

from gateway.engines import sse
from gateway.turns.intake.request import TurnRequest

_encode = msgspec.json.Encoder().encode


def chunks(response: dict[str, Any], req: TurnRequest) -> list[dict[str, Any]]:
    chat = req.endpoint == "/v1/chat/completions"
    head = {k: response[k] for k in ("id", "created", "model") if k in response}
    head["object"] = "chat.completion.chunk" if chat else "text_completion"
    out = []
    for choice in response.get("choices") or ():
        # The whole answer's logprobs ride on its one chunk, in the non-streamed shape, which is also the streamed
        # one: chat's {"content": [per token]}, completions' parallel lists.
        piece = {"index": choice.get("index", 0), "logprobs": choice.get("logprobs"),
                 "finish_reason": choice.get("finish_reason")}
        if chat:
            message = choice.get("message") or {}
            piece["delta"] = {k: v for k, v in message.items() if v is not None}
            if piece["delta"].get("tool_calls"):     # stream deltas carry each call's position
                piece["delta"]["tool_calls"] = [{"index": i, **c} for i, c in enumerate(message["tool_calls"])]
        else:
            piece["text"] = choice.get("text", "")
        if "token_ids" in choice:
            piece["token_ids"] = choice["token_ids"]
        out.append({**head, "choices": [piece]})
    if req.include_usage and response.get("usage"):
        out.append({**head, "choices": [], "usage": response["usage"]})
    return out


async def restream(response: dict[str, Any], req: TurnRequest) -> AsyncGenerator[bytes, None]:
    for chunk in chunks(response, req):
        yield sse.frame(_encode(chunk))
    yield sse.frame(sse.DONE)
