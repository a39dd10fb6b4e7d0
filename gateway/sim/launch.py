"""`pd-gateway sim`: one simulated vLLM engine (P, D or co-located) on a socket it binds itself."""

from __future__ import annotations

import argparse
import asyncio
import socket
import uuid
from pathlib import Path

import msgspec
import uvicorn

from gateway.sim.engine_app import create_sim_app
from gateway.sim.kvevents import KVEventsConfig
from gateway.sim.settings import (DEFAULT_BLOCK_SIZE, DEFAULT_LEASE_S, DEFAULT_MAX_MODEL_LEN,
                                  DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_NUM_BLOCKS,
                                  DEFAULT_PIN_TTL_S, DEFAULT_VERSION, EXPIRY_MARGIN_S, SimSettings)

ROLES = {"prefill": "prefill", "decode": "decode", "colocated": "colocated",
         "kv_producer": "prefill", "kv_consumer": "decode"}


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    low, high = int(lo), int(hi or lo)
    if not 1 <= low <= high:
        raise argparse.ArgumentTypeError("expected MIN:MAX with 1 <= MIN <= MAX")
    return low, high


def _kv_events(text: str) -> KVEventsConfig:
    try:
        return msgspec.json.decode(text, type=KVEventsConfig)
    except msgspec.DecodeError as exc:
        raise argparse.ArgumentTypeError(f"--kv-events-config: {exc}") from exc


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pd-gateway sim", description="A simulated vLLM engine with an oracle.")
    a = p.add_argument
    a("--role", choices=sorted(ROLES), default="colocated")
    a("--host", default="127.0.0.1")
    a("--port", type=int, default=0)
    a("--port-file", type=Path, help="write the bound port here once listening")
    a("--engine-id", default=None)
    a("--model", default="demo", help="served model name")
    a("--tokenizer", default="builtin:demo", help="builtin:NAME, a local path or a Hugging Face id")
    a("--chat-template", default=None)
    a("--block-size", type=int, default=DEFAULT_BLOCK_SIZE)
    a("--num-blocks", type=int, default=DEFAULT_NUM_BLOCKS)
    a("--max-model-len", type=int, default=DEFAULT_MAX_MODEL_LEN)
    a("--no-bidirectional", action="store_true")
    a("--kv-lease-duration", type=float, default=DEFAULT_LEASE_S)
    a("--decoder-kv-blocks-ttl", type=float, default=DEFAULT_PIN_TTL_S)
    a("--expiry-margin-s", type=float, default=EXPIRY_MARGIN_S,
      help="a reader declines a handle expiring within this (vLLM: 5 s); lower it only to compress time")
    a("--kv-recompute-threshold", type=int, default=None, help="default 64 when bidirectional, else 0")
    a("--kv-load-failure-policy", choices=["recompute", "fail"], default="fail")
    a("--no-prefix-caching", action="store_true")
    a("--stream-kv-params", action="store_true", help="put the handle in the final SSE chunk (patched vLLM)")
    a("--non-canonical", action="store_true", help="emit some words as token splits that re-encode differently")
    a("--reasoning", action="store_true", help="answers open with <think>…</think>, parsed out as reasoning")
    a("--no-prompt-token-ids", action="store_true", help="ignore kv_transfer_params.prompt_token_ids (< 0.32)")
    a("--prefill-ms-per-token", type=float, default=0.0)
    a("--decode-ms-per-token", type=float, default=0.0)
    a("--transfer-ms-per-block", type=float, default=0.0,
      help="KV transfer time per block, paid by D's read (pull) or P's write (push)")
    a("--kv-transfer-mode", choices=["pull", "push"], default="pull",
      help="pull: NixlConnector; push: NixlPushConnector (needs --no-bidirectional), docs/protocol.md §8")
    a("--push-registration-timeout", type=float, default=None,
      help="D's soft watchdog on a push registration (default: --decoder-kv-blocks-ttl); it only logs")
    a("--push-fault", choices=["none", "fail-prefill", "never-write"], default="none",
      help="push-mode P: its P legs fail with HTTP 500, or it answers but never writes into D's blocks")
    a("--transfer-ms-per-read", type=float, default=0.0,
      help="a KV read's or push write's fixed part (on an H200 D's leg after P took 50-73 ms: bench/GPU-RESULTS.md)")
    a("--max-num-seqs", type=int, default=256)
    a("--batched-steps", action="store_true",
      help="running requests share the engine's steps: a prefill lengthens the steps other streams decode in")
    a("--max-num-batched-tokens", type=int, default=DEFAULT_MAX_NUM_BATCHED_TOKENS)
    a("--output-tokens", type=_range, default=(8, 40), help="natural answer length MIN:MAX tokens")
    a("--enable-auto-tool-choice", action="store_true", help="let the model call tools (tool_choice auto)")
    a("--tool-call-parser", choices=["hermes"], default=None, help="how tool calls are parsed (vLLM's hermes)")
    a("--tool-call-rate", type=float, default=0.5, help="share of auto-tool-choice answers that call tools")
    a("--tool-call-style", choices=["template", "varied"], default="template",
      help="varied: some calls' JSON is compact, arguments-first or \\u-escaped (re-renders differently)")
    a("--tool-call-rounds", type=int, default=0,
      help="the model answers in text after this many rounds of tool calls since the last user message "
           "(an agent loop ends); 0: no limit")
    a("--kv-events-config", type=_kv_events, default=None,
      help='vLLM\'s KV events, e.g. \'{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557",'
           '"topic":"kv"}\' (docs/protocol.md §10)')
    a("--version", default=DEFAULT_VERSION, help="version string reported at /version")
    a("--log-level", default="warning")
    return p


def settings_from(args: argparse.Namespace, port: int) -> SimSettings:
    return SimSettings(
        role=ROLES[args.role], host=args.host, port=port, engine_id=args.engine_id or str(uuid.uuid4()),
        model=args.model, tokenizer=args.tokenizer, chat_template=args.chat_template, block_size=args.block_size,
        num_blocks=args.num_blocks, max_model_len=args.max_model_len, bidirectional=not args.no_bidirectional,
        kv_lease_duration=args.kv_lease_duration, decoder_kv_blocks_ttl=args.decoder_kv_blocks_ttl,
        expiry_margin_s=args.expiry_margin_s,
        kv_recompute_threshold=args.kv_recompute_threshold, kv_load_failure_policy=args.kv_load_failure_policy,
        prefix_caching=not args.no_prefix_caching, stream_kv_params=args.stream_kv_params,
        canonical=not args.non_canonical, reasoning=args.reasoning,
        honour_prompt_token_ids=not args.no_prompt_token_ids, prefill_ms_per_token=args.prefill_ms_per_token,
        decode_ms_per_token=args.decode_ms_per_token, transfer_ms_per_block=args.transfer_ms_per_block,
        transfer_ms_per_read=args.transfer_ms_per_read,
        max_num_seqs=args.max_num_seqs, output_tokens=args.output_tokens, version=args.version,
        batched_steps=args.batched_steps, max_num_batched_tokens=args.max_num_batched_tokens,
        enable_auto_tool_choice=args.enable_auto_tool_choice, tool_call_parser=args.tool_call_parser,
        tool_call_rate=args.tool_call_rate, tool_call_style=args.tool_call_style,
        tool_call_rounds=args.tool_call_rounds,
        transfer_mode=args.kv_transfer_mode, push_registration_timeout=args.push_registration_timeout,
        push_fault=args.push_fault, kv_events=args.kv_events_config)


def main(argv: list[str] | None = None) -> None:
    cli = parser()
    args = cli.parse_args(argv)
    # Bind first: the handles advertise the real port, and tests read it back from --port-file.
    sock = bind(args.host, args.port)
    try:
        settings = settings_from(args, sock.getsockname()[1])
    except ValueError as exc:  # settings vLLM refuses at start-up (e.g. push with bidirectional transfer)
        sock.close()
        cli.error(str(exc))
    app = create_sim_app(settings)
    config = uvicorn.Config(app, log_level=args.log_level, lifespan="on", timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)
    asyncio.run(_serve(server, sock, args.port_file, settings.port))


def bind(host: str, port: int) -> socket.socket:
    """A listening socket whose connections get TCP_NODELAY, as vLLM's (uvloop) server's do: asyncio sets it
    only on sockets made with proto IPPROTO_TCP, and without it a response written in two parts waits 40 ms
    for the client's delayed ACK. Accepted sockets inherit both settings."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    return sock


async def _serve(server: uvicorn.Server, sock: socket.socket, port_file: Path | None, port: int) -> None:
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not serving.done():
        await asyncio.sleep(0.01)
    if port_file is not None and server.started:
        port_file.write_text(str(port))
    await serving


