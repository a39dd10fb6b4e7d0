"""Chat and completions requests, from JSON body to engine request to vLLM-shaped JSON or SSE.

Mirrors vLLM's `serving_chat` / `serving_completion`: render (or take `kv_transfer_params.prompt_token_ids`),
validate lengths, run the engine request, detokenize, split reasoning, and frame the stream.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

import msgspec

from gateway.sim import logprobs as lp
from gateway.sim import wire
from gateway.sim.blocks import PoolExhaustedError
from gateway.sim.engine_core import Engine, EngineRequest, Running
from gateway.sim.failures import KVLoadParked, RequestFailed
from gateway.sim.generate import THINK_CLOSE, THINK_OPEN
from gateway.sim.chat_render import Renderer, RenderError
from gateway.sim.settings import SimSettings
from gateway.sim.structured import StructuredOutputError, schema_of
from gateway.sim.hermes_tools import (ToolRequestError, ToolSpec, ToolStream, extract, finish_reason, message_calls,
                               tool_rounds, tool_spec)

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # vLLM's /v1/completions default


class SimRequestError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass
class Call:
    """One validated request: what the engine runs and how the answer is shaped."""

    kind: str  # "chat" | "completion"
    external_id: str
    body: wire.SamplingFields
    engine_req: EngineRequest
    tools: ToolSpec | None = None     # chat with tools the model may call (see tools.py)
    logprobs: int | None = None       # alternatives per generated position (None: no logprobs asked)

    @property
    def wants_ids(self) -> bool:
        return bool(self.body.return_token_ids)


class Serving:
    def __init__(self, settings: SimSettings, renderer: Renderer, engine: Engine) -> None:
        self.settings = settings
        self.renderer = renderer
        self.engine = engine
        self.think_ids = (renderer.tokenizer.convert_tokens_to_ids(THINK_OPEN),
                          renderer.tokenizer.convert_tokens_to_ids(THINK_CLOSE))

    # -- request → Call ---------------------------------------------------------------------------------
    def chat_call(self, raw: bytes, header_id: str | None) -> Call:
        body = _decode(raw, wire.ChatRequest)
        self._check_model(body.model)
        try:
            tools = tool_spec(body.tools, body.tool_choice, auto_enabled=self._auto_tools)
        except ToolRequestError as exc:
            raise SimRequestError(400, str(exc)) from exc
        try:
            prompt = _pinned_prompt(body, self.settings, self.renderer) or self.renderer.render_chat(
                body.messages, add_generation_prompt=body.add_generation_prompt, tools=body.tools,
                template_kwargs=body.chat_template_kwargs)
        except RenderError as exc:
            raise SimRequestError(400, str(exc)) from exc
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        call = self._call("chat", "chatcmpl-", body, prompt, max_tokens, header_id,
                          _wanted(body.logprobs, body.top_logprobs, chat=True))
        call.tools = call.engine_req.tools = tools
        limit = self.settings.tool_call_rounds
        if tools is not None and tools.mode == "auto" and limit and self._rounds(body, prompt) >= limit:
            call.engine_req.tools = None      # the model answers in text; the serving still parses its answer
        return call

    def _rounds(self, body: wire.ChatRequest, prompt: list[int]) -> int:
        """Rounds of tool calls in what the model sees: the prompt, whose messages may be only the last one."""
        rounds = self.renderer.tool_rounds(prompt)
        return tool_rounds(body.messages) if rounds is None else rounds

    @property
    def _auto_tools(self) -> bool:
        return self.settings.enable_auto_tool_choice and self.settings.tool_call_parser is not None

    def completion_call(self, raw: bytes, header_id: str | None) -> Call:
        body = _decode(raw, wire.CompletionRequest)
        self._check_model(body.model)
        prompt = _pinned_prompt(body, self.settings, self.renderer) or _completion_prompt(body.prompt, self.renderer)
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
        return self._call("completion", "cmpl-", body, prompt, max_tokens, header_id,
                          _wanted(body.logprobs, None, chat=False))

    def _call(self, kind: str, prefix: str, body: wire.SamplingFields, prompt: list[int],
              max_tokens: int | None, header_id: str | None, logprobs: int | None = None) -> Call:
        if body.n != 1:
            raise SimRequestError(400, "n must be 1: the simulator serves one choice per request")
        limit = self.settings.max_model_len
        if not prompt:
            raise SimRequestError(400, "The prompt cannot be empty.")
        if len(prompt) >= limit:
            raise SimRequestError(400, f"This model's maximum context length is {limit} tokens. However, your "
                                       f"request has {len(prompt)} input tokens. Please reduce the length of "
                                       "the input messages.")
        if max_tokens is None:
            max_tokens = limit - len(prompt)
        if max_tokens < 1 or len(prompt) + max_tokens > limit:
            raise SimRequestError(400, f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. "
                                       f"This model's maximum context length is {limit} tokens and your request "
                                       f"has {len(prompt)} input tokens ({max_tokens} > {limit} - {len(prompt)}).")
        # vLLM's SamplingParams._verify_args (vllm/sampling_params.py) refuses both, in these words
        if body.min_tokens < 0:
            raise SimRequestError(400, f"min_tokens must be greater than or equal to 0, got {body.min_tokens}.")
        if body.min_tokens > max_tokens:
            raise SimRequestError(400, f"min_tokens must be less than or equal to max_tokens={max_tokens}, "
                                       f"got {body.min_tokens}.")
        try:
            schema = schema_of(body.response_format)
        except StructuredOutputError as exc:
            raise SimRequestError(400, str(exc)) from exc
        external = prefix + (header_id or body.request_id or secrets.token_hex(16))
        req = EngineRequest(f"{external}-{secrets.token_hex(4)}", prompt, max_tokens,
                            kv_params=_connector_params(body.kv_transfer_params, self.settings.honour_prompt_token_ids),
                            cache_salt=body.cache_salt, min_tokens=body.min_tokens, ignore_eos=body.ignore_eos,
                            seed=body.seed, stop=body.stop_list(), schema=schema)
        return Call(kind, external, body, req, logprobs=logprobs)

    def logprobs(self, call: Call, run: Running, tokens: list[int], start: int, offset: int = 0,
                 ) -> dict[str, Any] | None:
        """`choice.logprobs` for `tokens`, generated from position `start` of the answer (None: not asked)."""
        if call.logprobs is None:
            return None
        vocab = len(self.renderer)
        steps = [(t, lp.distribution(run.digest, start + i, t, vocab)) for i, t in enumerate(tokens)]
        as_ids = bool(call.body.return_tokens_as_token_ids)
        if call.kind == "chat":
            return lp.chat(steps, call.logprobs, self.renderer.decode, as_ids)
        return lp.completion(steps, call.logprobs, self.renderer.decode, as_ids, offset)

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.settings.model:
            raise SimRequestError(404, f"The model `{model}` does not exist.")

    # -- non-streaming ----------------------------------------------------------------------------------
    async def respond(self, call: Call) -> dict[str, Any]:
        try:
            run = await self.engine.admit(call.engine_req)
        except RequestFailed as exc:  # a failed load, an injected fault, a push leg without P's identity
            raise SimRequestError(500, "Internal server error") from exc
        except PoolExhaustedError as exc:
            raise SimRequestError(400, str(exc)) from exc
        try:
            out = [t async for t in self.engine.decode(run)]
        except BaseException:
            self.engine.abort(run)
            raise
        handle = self.engine.finish(run)
        return self._final(call, run, out, handle)

    def _final(self, call: Call, run: Running, out: list[int], handle: dict[str, Any] | None) -> dict[str, Any]:
        model, ans, prompt = self.settings.model, run.answer, call.engine_req.prompt
        ids = out if call.wants_ids else None
        prompt_ids = prompt if call.wants_ids else None
        logprobs = self.logprobs(call, run, out, 0)
        if call.kind == "completion":
            return wire.completion_response(
                call.external_id, model, text=self.renderer.decode(out), finish=ans.finish_reason,
                stop_reason=ans.stop_reason, token_ids=ids, prompt_ids=prompt_ids, n_prompt=len(prompt),
                n_out=len(out), kv_params=handle, logprobs=logprobs)
        reasoning, content = self._split(out)
        parsed = extract(call.tools, content or "") if call.tools else None
        if parsed is not None and parsed.called:
            content = parsed.content
        return wire.chat_response(
            call.external_id, model, content=content, reasoning=reasoning,
            finish=finish_reason(call.tools, parsed, ans.finish_reason), stop_reason=ans.stop_reason,
            token_ids=ids, prompt_ids=prompt_ids, n_prompt=len(prompt), n_out=len(out), kv_params=handle,
            tool_calls=message_calls(parsed) if parsed is not None and parsed.called else None, logprobs=logprobs)

    def _split(self, out: list[int]) -> tuple[str | None, str | None]:
        """vLLM's think-tag reasoning parser: text inside <think>…</think> is reasoning, the rest content."""
        text = self.renderer.decode(out)
        if not self.settings.reasoning:
            return None, text
        _, opened, rest = text.partition(THINK_OPEN)
        text = rest if opened else text
        if THINK_CLOSE not in text:
            return text, None
        reasoning, _, content = text.partition(THINK_CLOSE)
        return reasoning, content or None

    # -- streaming --------------------------------------------------------------------------------------
    async def stream(self, call: Call) -> AsyncIterator[bytes]:
        """SSE frames; the engine request is aborted (no handle) if the client goes away mid-stream."""
        obj = "chat.completion.chunk" if call.kind == "chat" else "text_completion"
        created, run = int(time.time()), None
        frame = _Framer(call, self.settings.model, created, obj, self.settings.stream_kv_params)
        try:
            try:
                run = await self.engine.admit(call.engine_req)
            except RequestFailed:
                yield wire.sse(wire.error_body("Internal server error", 500))
                yield wire.sse("[DONE]")
                return
            except KVLoadParked:
                self.engine.waiting += 1          # never answered; the stream ends when the client leaves
                try:
                    await asyncio.Event().wait()
                finally:
                    self.engine.waiting -= 1
            if call.kind == "chat":
                yield frame.role_chunk()
            out: list[int] = []
            state = _Pieces(self, out, call.tools, run.answer.token_ids)
            total = len(run.answer.token_ids)
            async for token in self.engine.decode(run):
                out.append(token)
                offset = len(state.text)
                delta = state.delta(token)
                last = len(out) == total
                handle = self.engine.finish(run) if last else None
                if delta is None and not last and not call.wants_ids:
                    continue            # vLLM sends no chunk for a token without text: its logprobs are lost too
                logprobs = self.logprobs(call, run, [token], len(out) - 1, offset)
                yield frame.token_chunk(token, delta or {}, run if last else None, handle, len(out) == 1,
                                        state.finish_reason if last else None, logprobs)
            if not run.done:  # a stop string matched at once: nothing generated
                handle = self.engine.finish(run)
                yield frame.token_chunk(-1, {}, run, handle, False)
            if call.body.stream_options and call.body.stream_options.include_usage:
                yield wire.sse(wire.chunk(call.external_id, self.settings.model, created, obj, [],
                                          usage=wire.usage(len(call.engine_req.prompt), len(out))))
            yield wire.sse("[DONE]")
        finally:
            if run is not None:
                self.engine.abort(run)  # no-op after finish


class _Pieces:
    """Incremental detokenization, routed to `content` or `reasoning_content` like vLLM's parsers."""

    def __init__(self, serving: Serving, out: list[int], tools: ToolSpec | None = None,
                 final_ids: list[int] | None = None) -> None:
        self.serving, self.out = serving, out
        self.text = ""
        self._prefix = self._read = 0    # vLLM's incremental detokenizer's offsets (see `_piece`)
        self.in_think = False
        self.tools = self._tool_stream(tools, final_ids or [])
        self.content_at = 0          # where the content (after any reasoning) starts in the text

    def _tool_stream(self, tools: ToolSpec | None, final_ids: list[int]) -> ToolStream | None:
        if tools is None:
            return None
        _, content = self.serving._split(final_ids)
        return ToolStream(tools, content or "")

    @property
    def finish_reason(self) -> str | None:
        """"tool_calls" once the streamed answer called tools (auto or required), else the engine's."""
        if self.tools is None or not self.tools.called or self.tools.spec.mode == "named":
            return None
        return "tool_calls"

    def _piece(self) -> str:
        """The text the newest token adds, as vLLM's incremental detokenizer finds it: the window from the token
        before the last piece decoded with and without the new tokens (both start at the same token, so a
        tokenizer's leading-space rule cancels out), nothing while the window ends in an incomplete character.
        Decoding the whole answer each token cost O(n) per token: 0.2 ms a token at 1,000-token answers."""
        decode = self.serving.renderer.decode
        before, now = decode(self.out[self._prefix:self._read]), decode(self.out[self._prefix:])
        if len(now) <= len(before) or now.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self.out)
        return now[len(before):]

    def delta(self, token: int) -> dict[str, Any] | None:
        piece = self._piece()
        self.text += piece
        text = self.text
        reasoning = self.serving.settings.reasoning
        if reasoning and token in self.serving.think_ids:
            self.in_think = token == self.serving.think_ids[0]
            self.content_at = len(text)
            return None
        if self.in_think:
            return {"reasoning_content": piece, "reasoning": piece}
        if self.tools is not None:
            return self.tools.delta(text[self.content_at:])
        return {"content": piece}


class _Framer:
    def __init__(self, call: Call, model: str, created: int, obj: str, stream_kv_params: bool) -> None:
        self.call, self.model, self.created, self.obj = call, model, created, obj
        self.stream_kv_params = stream_kv_params  # a patched vLLM puts the handle in the finish chunk

    def role_chunk(self) -> bytes:
        top = {"prompt_token_ids": self.call.engine_req.prompt} if self.call.wants_ids else {}
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None}
        return wire.sse(wire.chunk(self.call.external_id, self.model, self.created, self.obj, [choice], **top))

    def token_chunk(self, token: int, delta: dict[str, Any], finished: Running | None,
                    handle: dict[str, Any] | None, first: bool, finish: str | None = None,
                    logprobs: dict[str, Any] | None = None) -> bytes:
        choice: dict[str, Any]
        if self.call.kind == "chat":
            choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": None}
        else:
            text = delta.get("content", delta.get("reasoning_content", ""))
            choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": None, "stop_reason": None}
            if first and self.call.wants_ids:
                choice["prompt_token_ids"] = self.call.engine_req.prompt
        if self.call.wants_ids:
            choice["token_ids"] = [token] if token >= 0 else []
        top: dict[str, Any] = {}
        if finished is not None:
            choice["finish_reason"] = finish or finished.answer.finish_reason
            choice["stop_reason"] = finished.answer.stop_reason
            if handle is not None and self.stream_kv_params:
                top["kv_transfer_params"] = handle
        return wire.sse(wire.chunk(self.call.external_id, self.model, self.created, self.obj, [choice], **top))



def _pinned_prompt(body: wire.SamplingFields, settings: SimSettings, renderer: Renderer) -> list[int] | None:
    """vLLM 0.32+: `kv_transfer_params.prompt_token_ids` replaces rendering."""
    params = body.kv_transfer_params or {}
    ids = params.get("prompt_token_ids")
    if not settings.honour_prompt_token_ids or not ids:
        return None
    if not all(isinstance(i, int) and 0 <= i < len(renderer) for i in ids):
        raise SimRequestError(400, "kv_transfer_params.prompt_token_ids holds invalid token ids")
    return list(ids)


def _completion_prompt(prompt: Any, renderer: Renderer) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return renderer.render_prompt(prompt)
    if isinstance(prompt, list) and all(isinstance(i, int) for i in prompt):
        if any(not 0 <= i < len(renderer) for i in prompt):
            raise SimRequestError(400, "Token id out of vocabulary")
        return list(prompt)
    raise SimRequestError(400, "Only a single prompt is supported")


def _wanted(logprobs: bool | int | None, top_logprobs: int | None, *, chat: bool) -> int | None:
    try:
        return lp.check(logprobs, top_logprobs, chat=chat)
    except ValueError as exc:
        raise SimRequestError(400, str(exc)) from exc


def _decode(raw: bytes, kind: type) -> Any:
    try:
        return msgspec.json.decode(raw, type=kind)
    except msgspec.ValidationError as exc:
        raise SimRequestError(400, str(exc)) from exc
    except msgspec.DecodeError as exc:
        raise SimRequestError(400, f"Invalid JSON body: {exc}") from exc


def _connector_params(params: dict[str, Any] | None, pops_ids: bool = True) -> dict[str, Any] | None:
    """What the connector sees: vLLM 0.32's renderer pops `prompt_token_ids` (renderers/online_renderer.py:105-150),
    and params left empty count as none (chat_completion/protocol.py:747-749): no handle at the end. An engine
    before 0.32 (`--no-prompt-token-ids`) passes the params on as sent (vLLM 0.25 chat_completion/protocol.py:665-667
    hands them to the connector whole): the ids alone are params, and a bidirectional D pins their request."""
    if not params:
        return None
    rest = {k: v for k, v in params.items() if k != "prompt_token_ids"} if pops_ids else params
    return rest or None
