"""`create_sim_app(settings)`: the simulated engine's HTTP surface, vLLM's routes plus the `/sim/*` ones.

`/sim/kv/*` stand in for NIXL between sims (see `kv_reader.py`); `/sim/stats` and `/sim/reset` serve tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from contextlib import asynccontextmanager
from typing import Annotated, Any, AsyncIterator, Awaitable

import msgspec
from litestar import Litestar, MediaType, Request, Response, get, post
from litestar.response import Stream

from gateway.sim import wire
from gateway.sim.engine_core import Engine
from gateway.sim.failures import KVLoadParked
from gateway.sim.metrics import render_metrics
from gateway.sim.push import push_routes
from gateway.sim.chat_render import Renderer, RenderError
from gateway.sim.openai_serving import Serving, SimRequestError
from gateway.sim.settings import SimSettings
from gateway.sim.kv_reader import KVHeartbeatRequest, KVNotifyRequest, KVReadRequest

MAX_BODY_BYTES = 64 * 1024 * 1024
log = logging.getLogger("gateway.sim")


def _json(payload: Any, status: int = 200) -> Response:
    return Response(content=msgspec.json.encode(payload), status_code=status, media_type=MediaType.JSON)


def _error(_: Request, exc: Exception) -> Response:
    if isinstance(exc, SimRequestError):
        return _json(wire.error_body(exc.message, exc.status), exc.status)
    status = getattr(exc, "status_code", 500)
    if status >= 500:
        log.error("unhandled error", exc_info=exc)
    message = getattr(exc, "detail", None) or "Internal server error"
    return _json(wire.error_body(str(message) if status < 500 else "Internal server error", status), status)


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_client_leaves(request: Request, work: Awaitable[Any]) -> Any:
    """vLLM aborts a non-streamed request whose client goes away (`with_cancellation`,
    entrypoints/serve/utils/api_utils.py:51): `work` is cancelled then, and None returned."""
    task, gone = asyncio.ensure_future(work), asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        gone.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return None


class ResetRequest(msgspec.Struct):
    num_blocks: Annotated[int, msgspec.Meta(ge=1)] | None = None  # resize the KV pool (benchmark sweeps)


TIMING_FIELDS = ("prefill_ms_per_token", "decode_ms_per_token", "transfer_ms_per_block", "transfer_ms_per_read",
                 "batched_steps")


def create_sim_app(settings: SimSettings) -> Litestar:
    renderer = Renderer(settings.tokenizer, settings.chat_template)
    engine = Engine(settings, renderer)
    serving = Serving(settings, renderer, engine)

    @asynccontextmanager
    async def lifespan(_: Litestar) -> AsyncIterator[None]:
        await engine.start()
        try:
            yield
        finally:
            await engine.close()

    async def _run(call_of: Any, request: Request) -> Response | Stream:
        call = call_of(await request.body(), request.headers.get("x-request-id"))
        if engine.parks(call.engine_req.kv_params):
            return await _park(request, counted=False)  # a transfer never scheduled, not even counted waiting
        if call.body.stream:
            return Stream(serving.stream(call), media_type="text/event-stream", status_code=200)
        try:
            answer = await _unless_client_leaves(request, serving.respond(call))
            return Response(content=b"", status_code=499) if answer is None else _json(answer)
        except KVLoadParked:
            return await _park(request, counted=True)   # a declined read under `recompute`: never rescheduled

    async def _park(request: Request, *, counted: bool) -> Response:
        """Unanswered until the client leaves; `counted`: as waiting, reason 'deferred' (vllm-findings.md 5, 8)."""
        with engine.waiting_meanwhile(deferred=True, seated=False) if counted else contextlib.nullcontext():
            await _until_disconnect(request)
        return Response(content=b"", status_code=499)

    @post("/v1/chat/completions", status_code=200)
    async def chat(request: Request) -> Response | Stream:
        return await _run(serving.chat_call, request)

    @post("/v1/completions", status_code=200)
    async def completions(request: Request) -> Response | Stream:
        return await _run(serving.completion_call, request)

    @post("/tokenize", status_code=200)
    async def tokenize(request: Request) -> Response:
        body = msgspec.json.decode(await request.body(), type=wire.TokenizeRequest)
        if body.messages is not None:
            try:
                ids = renderer.render_chat(body.messages, add_generation_prompt=body.add_generation_prompt,
                                           tools=body.tools, template_kwargs=body.chat_template_kwargs)
            except RenderError as exc:
                raise SimRequestError(400, str(exc)) from exc
        else:
            ids = renderer.render_prompt(body.prompt or "")
        strs = renderer.token_strs(ids) if body.return_token_strs else None
        return _json({"count": len(ids), "max_model_len": settings.max_model_len, "tokens": ids,
                      "token_strs": strs})

    @get("/v1/models")
    async def models() -> Response:
        card = {"id": settings.model, "object": "model", "created": int(time.time()), "owned_by": "vllm",
                "root": settings.tokenizer, "parent": None, "max_model_len": settings.max_model_len,
                "permission": []}
        return _json({"object": "list", "data": [card]})

    @get("/health")
    async def health() -> Response:
        return Response(content=b"", status_code=500 if engine.dead else 200)   # vLLM: its engine core died

    @get("/version")
    async def version() -> Response:
        return _json({"version": settings.version})

    @get("/server_info")
    async def server_info() -> Response:
        """vLLM's dev-mode /server_info?config_format=json, reduced to the KV-transfer and cache config. The
        connector's name says the transfer mode (docs/protocol.md §8.5)."""
        s = engine.settings
        extra: dict[str, Any] = {"bidirectional_kv_xfer": s.bidirectional, "kv_lease_duration": s.kv_lease_duration,
                                 "decoder_kv_blocks_ttl": s.decoder_kv_blocks_ttl}
        if s.transfer_mode == "push":
            extra["push_registration_timeout"] = s.registration_timeout
        kv = None if not s.has_connector else {
            "kv_connector": "NixlPushConnector" if s.transfer_mode == "push" else "NixlConnector",
            "engine_id": s.engine_id, "kv_role": "kv_producer" if s.role == "prefill" else "kv_consumer",
            "kv_load_failure_policy": s.kv_load_failure_policy, "kv_connector_extra_config": extra}
        return _json({"vllm_config": {"kv_transfer_config": kv, "cache_config": {"block_size": s.block_size}}})

    @get("/metrics")
    async def metrics() -> Response:
        return Response(content=render_metrics(engine), media_type="text/plain; version=0.0.4; charset=utf-8")

    @get("/sim/stats")
    async def stats() -> Response:
        engine.handles.expire()
        return _json({"engine_id": settings.engine_id, "role": settings.role, "block_size": settings.block_size,
                      **msgspec.structs.asdict(engine.stats), "handles_pinned": engine.handles.count("pin"),
                      "handles_leased_now": engine.handles.count("lease"), "blocks_in_use": engine.pool.in_use,
                      "blocks_cached": len(engine.pool.cached), "running": engine.running,
                      "waiting": engine.waiting, "push_registrations_pending": len(engine.push_sender.pending),
                      "push_blocks_staged": len(engine.push_sender.staged),
                      "push_waiting": len(engine.push_receiver.waiting) - engine.push_receiver.orphans,
                      "push_orphans": engine.push_receiver.orphans,
                      "kv_events_endpoint": engine.events.endpoint if engine.events else None,
                      "kv_event_batches": engine.events.sent if engine.events else 0})

    @post("/sim/reset", status_code=200)
    async def reset(request: Request) -> Response:
        try:
            body = msgspec.json.decode(await request.body() or b"{}", type=ResetRequest)
        except msgspec.DecodeError as exc:
            return _json(wire.error_body(str(exc), 400), 400)
        engine.reset(body.num_blocks)
        return _json({"ok": True, "num_blocks": engine.settings.num_blocks})

    @post("/sim/kv/read", status_code=200)
    async def kv_read(request: Request) -> Response:
        body = msgspec.json.decode(await request.body(), type=KVReadRequest)
        if (body.engine_id != settings.engine_id or body.block_size != settings.block_size
                or engine.settings.transfer_mode != "pull"):  # the mode is in NIXL's compatibility hash
            return _json(wire.error_body("handshake refused: engine id, block size or transfer mode mismatch",
                                         400), 409)
        if any(not 0 <= i < engine.settings.num_blocks for i in body.block_ids):
            return _json(wire.error_body("block id out of range", 400), 400)
        blocks = [list(engine.pool.blocks[i].slots) for i in body.block_ids]  # copied before they are freed
        return _json({"blocks": blocks, "claim": engine.handles.claim(body.request_id, "read")})

    @post("/sim/kv/notify", status_code=200)
    async def kv_notify(request: Request) -> Response:
        body = msgspec.json.decode(await request.body(), type=KVNotifyRequest)
        if body.engine_id != settings.engine_id:
            return _json(wire.error_body("engine id mismatch", 400), 409)
        return _json({"claim": engine.handles.claim(body.request_id, "notify")})

    @post("/sim/kv/heartbeat", status_code=200)
    async def kv_heartbeat(request: Request) -> Response:
        body = msgspec.json.decode(await request.body(), type=KVHeartbeatRequest)
        engine.stats.heartbeats_received += 1
        # the holder extends to two thirds of its own lease from now (nixl/base_worker.py:528-532)
        return _json({"extended": engine.handles.heartbeat(body.request_id, settings.kv_lease_duration * 2 / 3)})

    @post("/sim/timing", status_code=200)
    async def timing(request: Request) -> Response:
        """Test hook: change the timing model while running (e.g. make this engine slow past a deadline)."""
        changes = msgspec.json.decode(await request.body(), type=dict[str, float])
        unknown = set(changes) - set(TIMING_FIELDS)
        if unknown:
            return _json(wire.error_body(f"not timing fields: {sorted(unknown)}", 400), 400)
        engine.settings = msgspec.structs.replace(engine.settings, **changes)
        return _json({name: getattr(engine.settings, name) for name in TIMING_FIELDS})

    return Litestar(
        route_handlers=[chat, completions, tokenize, models, health, version, server_info, metrics, stats,
                        reset, timing, kv_read, kv_notify, kv_heartbeat, *push_routes(engine)],
        lifespan=[lifespan], exception_handlers={Exception: _error}, request_max_body_size=MAX_BODY_BYTES,
        openapi_config=None)
