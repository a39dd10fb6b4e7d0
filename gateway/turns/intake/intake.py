"""From a validated client request to a TurnRequest: model check, rendering, fields the engines must not see."""

from __future__ import annotations

from typing import Any

import msgspec

from gateway.errors import InvalidRequestError, ModelNotFoundError
from gateway.turns.intake.context import COMPLETIONS_DEFAULT_MAX_TOKENS, ContextLimit, longest_token_chars
from gateway.turns.intake.message_cache import Messages
from gateway.turns.intake.prompts import Lineage
from gateway.turns.intake.request import Endpoint, TurnRequest
from gateway.turns.intake.render import Renderer
from gateway.turns.intake.tools import check_chat

# Never forwarded: a client handle could point an engine at any host or another conversation's blocks.
_STRIPPED = ("kv_transfer_params", "conversation_id", "session_id", "request_id")
_encode = msgspec.json.Encoder().encode


class Intake:
    def __init__(self, renderer: Renderer, served_models: list[str], max_messages: int = 4096,
                 history_tokens: str = "generated", max_model_len: int | None = None,
                 aliases: tuple[str, ...] = ()) -> None:
        self.renderer = renderer
        self.context = ContextLimit(max_model_len, longest_token_chars(renderer.tokenizer) if max_model_len else 0)
        self.served_models = served_models
        self.aliases = aliases              # other names requests may give the model (a deployment file's)
        self.max_messages = max_messages
        self.generated_history = history_tokens == "generated"

    def model_for(self, requested: str | None) -> str:
        if not self.served_models:
            return requested or ""
        if requested is None or requested in self.aliases:
            return self.served_models[0]
        if requested not in self.served_models:
            raise ModelNotFoundError(f"The model `{requested}` does not exist.", param="model")
        return requested

    def chat(self, body: dict[str, Any], req: Any, request_id: str) -> TurnRequest:
        if len(req.messages) > self.max_messages:
            raise InvalidRequestError(f"at most {self.max_messages} messages are accepted", param="messages")
        model = self.model_for(req.model)
        check_chat(body)
        template = dict(tools=body.get("tools"), add_generation_prompt=req.add_generation_prompt,
                        continue_final_message=req.continue_final_message,
                        chat_template_kwargs=req.chat_template_kwargs)
        # render_chat in two steps, so that a text far over the context length is refused before it is encoded
        text = self.renderer.template(body["messages"], **template)
        self.context.check_text(text, "messages")
        lineage = lineage_of(body["messages"], template)
        ids = self.renderer.encode(text, lineage)
        wanted = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        self.context.check_tokens(len(ids), wanted, "messages")
        turn = self._turn("/v1/chat/completions", body, req, model, ids, request_id)
        if self.generated_history:
            turn.rerender = lambda answers: self.renderer.render_chat(body["messages"], answers=answers,
                                                                      rendered=text, lineage=lineage, **template)
        return turn

    def completion(self, body: dict[str, Any], req: Any, request_id: str) -> TurnRequest:
        model = self.model_for(req.model)
        if isinstance(req.prompt, str):
            self.context.check_text(req.prompt, "prompt")
        ids = self.renderer.render_prompt(req.prompt)
        wanted = COMPLETIONS_DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
        self.context.check_tokens(len(ids), wanted, "prompt")
        return self._turn("/v1/completions", body, req, model, ids, request_id)

    @staticmethod
    def _turn(endpoint: Endpoint, body: dict[str, Any], req: Any, model: str, ids: list[int],
              request_id: str) -> TurnRequest:
        clean = {k: v for k, v in body.items() if k not in _STRIPPED}
        if model:
            clean["model"] = model
        return TurnRequest(
            endpoint=endpoint, body=clean, model=model, prompt_ids=ids, stream=bool(req.stream),
            want_token_ids=bool(req.return_token_ids),
            include_usage=bool(req.stream_options and req.stream_options.include_usage), request_id=request_id)


def lineage_of(messages: list[dict[str, Any]], template: dict[str, Any]) -> Lineage | None:
    """The keys by which this prompt finds the one it continues: its messages' (from their bytes when parsed
    by api/schemas.py), and the template's other inputs."""
    try:
        keys = messages.keys if isinstance(messages, Messages) else [hash(_encode(m)) for m in messages]
        inputs = _encode([template.get("tools"), template.get("chat_template_kwargs")])
    except TypeError:                    # not JSON (a caller's own objects): nothing to continue from
        return None
    return Lineage(keys, inputs)
