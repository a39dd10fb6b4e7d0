"""`pd-gateway demo`: a gateway, one simulated P, one simulated D and the embedded store, all local; a scripted
multi-turn chat, one table row per turn. `--serve` keeps everything running for your own requests.

Its three processes are children of this one: any way this one is asked to stop (Ctrl-C, SIGTERM, SIGHUP) stops
them too, so no orphan keeps port 8000. They run in sessions of their own, so Ctrl-C reaches only this process,
which stops them with SIGTERM: a child interrupted by the terminal's SIGINT wrote a KeyboardInterrupt traceback
into its log (during its imports, before its server handles signals) and left this one talking to a dead port.
Their logs are kept only in `--log-dir DIR`; otherwise they live in a temporary folder removed at exit (a
component that fails to start has its log's last lines printed first)."""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from gateway.processes import Server, start

QUESTIONS = [
    "Hello! I am planning a small web service in Python. Where should I start?",
    "Which HTTP framework would you pick for an API that streams tokens?",
    "How should I structure the modules so the code stays readable as it grows?",
    "What would you test first, and how do I keep the test suite fast?",
    "How do I measure latency without fooling myself?",
    "Thanks. Can you summarise the plan in three steps?",
]


async def chat_turn(http: aiohttp.ClientSession, url: str, session: str, messages: list[dict]) -> dict:
    began, ttft, text = time.perf_counter(), None, []
    body = {"model": "demo", "messages": messages, "stream": True, "max_tokens": 160,
            "stream_options": {"include_usage": True}}
    prompt_tokens = 0
    async with http.post(url + "/v1/chat/completions", json=body, headers={"X-Session-Id": session}) as resp:
        resp.raise_for_status()
        async for line in resp.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            prompt_tokens = (chunk.get("usage") or {}).get("prompt_tokens", prompt_tokens)
            delta = chunk["choices"][0]["delta"] if chunk["choices"] else {}
            if delta.get("content"):
                ttft = ttft or time.perf_counter() - began
                text.append(delta["content"])
        return {"plan": resp.headers["X-PD-Plan"], "reason": resp.headers["X-PD-Reason"],
                "reused": int(resp.headers["X-PD-Reused-Tokens"]), "ttft_ms": (ttft or 0) * 1e3,
                "prompt": prompt_tokens,
                "answer": "".join(text)}


async def counters(http: aiohttp.ClientSession, engine: Server) -> tuple[int, int]:
    """The engine's prompt tokens prefilled and found in its prefix cache, so far."""
    async with http.get(engine.url + "/sim/stats") as resp:
        stats = await resp.json()
    return stats["prompt_tokens_computed"], stats["prompt_tokens_cached"]


async def script(gateway: Server, prefill: Server, decode: Server) -> list[dict]:
    """Each turn's prompt split by the engine that prefilled it, from its own counters: P on the P path, D alone
    on a `local` turn (whose reused tokens are D's cache hits on the KV it held). reused + cached + computed =
    prompt (D's one recomputed token after reading P's KV is the transfer's, not the prompt's)."""
    rows, messages = [], []
    async with aiohttp.ClientSession() as http:
        for question in QUESTIONS:
            messages.append({"role": "user", "content": question})
            before = {engine.url: await counters(http, engine) for engine in (prefill, decode)}
            row = await chat_turn(http, gateway.url, "demo-conversation", messages)
            engine = decode if row["plan"] == "local" else prefill
            (computed, cached), (computed_0, cached_0) = await counters(http, engine), before[engine.url]
            row["on"], row["computed"] = "D" if engine is decode else "P", computed - computed_0
            row["cached"] = cached - cached_0 - (row["reused"] if engine is decode else 0)
            messages.append({"role": "assistant", "content": row["answer"]})
            rows.append(row)
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"{'turn':>4}  {'plan':<8} {'reason':<16} {'prompt':>6} {'reused':>7} {'cached':>7} {'computed':>9} "
          f"{'on':>3} {'TTFT ms':>8}")
    for i, row in enumerate(rows, 1):
        print(f"{i:>4}  {row['plan']:<8} {row['reason']:<16} {row['prompt']:>6} {row['reused']:>7} "
              f"{row['cached']:>7} {row['computed']:>9} {row['on']:>3} {row['ttft_ms']:>8.1f}")
    print("\nprompt = reused (D's KV) + cached (the computing engine's prefix cache) + computed (prefilled on P, "
          "or on D alone for a local turn)")


class Stopped(Exception):
    """A stop signal arrived: unwind through `finally`, which stops the children."""


def _on_stop_signals() -> None:
    def stop(signum: int, _frame: object) -> None:
        raise Stopped(signal.Signals(signum).name)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, stop)


def port_in_use(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="pd-gateway demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--serve", action="store_true", help="keep the stack running after the script")
    parser.add_argument("--port", type=int, default=8000, help="gateway port with --serve")
    parser.add_argument("--tokenizer", default="builtin:demo")
    parser.add_argument("--log-dir", type=Path, default=None,
                        help="keep the components' logs (prefill.log, decode.log, gateway.log) in this folder")
    args = parser.parse_args(argv)
    if args.serve and port_in_use(args.port):
        raise SystemExit(f"pd-gateway demo: port {args.port} is in use (an earlier demo or gateway still "
                         "running?): stop it, or pass --port N")
    _on_stop_signals()
    if args.log_dir is not None:
        args.log_dir.mkdir(parents=True, exist_ok=True)
        print(f"component logs: {args.log_dir}/ (prefill.log, decode.log, gateway.log)", flush=True)
    logs = args.log_dir or Path(tempfile.mkdtemp(prefix="pd-gateway-demo-"))
    servers: list[Server] = []
    try:
        run(args, logs, servers)
    except (KeyboardInterrupt, Stopped):
        print("\nstopping", flush=True)
    except (RuntimeError, TimeoutError) as exc:      # a component did not start: its log says why
        lines = str(exc).splitlines()
        where = f" (its log: {args.log_dir}/)" if args.log_dir else ""
        print(f"pd-gateway demo: {lines[0]}{where}", *(["", *lines[1:][-20:]] if not where else []),
              sep="\n", file=sys.stderr)
        raise SystemExit(1) from None
    finally:
        # A second signal (or Ctrl-C) must not interrupt the clean-up
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
        for server in reversed(servers):
            server.stop()
        if args.log_dir is None:
            shutil.rmtree(logs, ignore_errors=True)


# What a coding agent needs of the engines (Claude Code and OpenCode ask max_tokens 32000 on prompts of ~30k
# tokens, every request with tools and tool_choice auto): tool calls parsed as vLLM's hermes parser does
# (docs/protocol.md §11; the simulated model answers in text after 3 rounds of calls, so an agent's loop ends), a
# 128k context, and KV for two such contexts per engine. The compose sim profile runs the same flags.
AGENT_READY = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--tool-call-rounds", "3",
               "--max-model-len", "131072", "--num-blocks", "16384"]


def sim_flags(tokenizer: str) -> list[str]:
    """The demo's simulated engines' flags, but for role and id (the `harness` test tier runs them too)."""
    # Answers longer than kv_recompute_threshold (64 tokens), so P reads them from D instead of recomputing. The
    # engines are timed like a 3B model on an H200 whose KV moves over CUDA IPC, where reading D's KV is several
    # times faster than computing it (bench/GPU-RESULTS.md), so the cost plan's probe finds, as there, that
    # reading pays. Untimed sims answer at the speed of their own bookkeeping, where moving KV over HTTP costs
    # more than "computing" it.
    return ["--tokenizer", tokenizer, "--stream-kv-params", "--output-tokens", "80:120",
            "--prefill-ms-per-token", "0.02", "--transfer-ms-per-block", "0.05", *AGENT_READY]


def run(args: argparse.Namespace, logs: Path, servers: list[Server]) -> None:
    sim = sim_flags(args.tokenizer)
    prefill = start(["sim", "--role", "prefill", "--engine-id", "demo-p", *sim], log_dir=logs, name="prefill",
                    own_session=True)
    servers.append(prefill)
    decode = start(["sim", "--role", "decode", "--engine-id", "demo-d", *sim], log_dir=logs, name="decode",
                   own_session=True)
    servers.append(decode)
    gateway = start(["serve", "--prefill", prefill.url, "--decode", decode.url, "--tokenizer", args.tokenizer,
                     "--log-level", "warning"],
                    port=args.port if args.serve else 0, log_dir=logs, name="gateway", own_session=True)
    servers.append(gateway)
    print(f"gateway {gateway.url}  prefill {prefill.url}  decode {decode.url}  store: embedded\n")
    print_table(asyncio.run(script(gateway, prefill, decode)))
    if args.serve:
        print(f"\nserving on {gateway.url} (Ctrl-C stops). Try:\n  curl -s {gateway.url}/v1/chat/completions "
              "-H 'Content-Type: application/json' -H 'X-Session-Id: s1' "
              "-d '{\"model\":\"demo\",\"messages\":[{\"role\":\"user\",\"content\":\"Hi\"}]}'", flush=True)
        gateway.proc.wait()
