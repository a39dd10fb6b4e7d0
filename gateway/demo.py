"""`pd-gateway demo`: a gateway, one simulated P, one simulated D and the embedded store, all local; a scripted
multi-turn chat, one table row per turn. `--serve` keeps everything running for your own requests."""

from __future__ import annotations

import argparse
import asyncio
import json
import time

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


async def computed_on(http: aiohttp.ClientSession, engine: Server) -> int:
    async with http.get(engine.url + "/sim/stats") as resp:
        return (await resp.json())["prompt_tokens_computed"]


async def script(gateway: Server, prefill: Server) -> list[dict]:
    rows, messages = [], []
    async with aiohttp.ClientSession() as http:
        for question in QUESTIONS:
            messages.append({"role": "user", "content": question})
            before = await computed_on(http, prefill)
            row = await chat_turn(http, gateway.url, "demo-conversation", messages)
            row["computed"] = await computed_on(http, prefill) - before
            messages.append({"role": "assistant", "content": row["answer"]})
            rows.append(row)
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"{'turn':>4}  {'plan':<8} {'reason':<16} {'prompt':>6} {'reused':>7} {'P computed':>10} {'TTFT ms':>8}")
    for i, row in enumerate(rows, 1):
        print(f"{i:>4}  {row['plan']:<8} {row['reason']:<16} {row['prompt']:>6} {row['reused']:>7} "
              f"{row['computed']:>10} {row['ttft_ms']:>8.1f}")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="pd-gateway demo", description=__doc__)
    parser.add_argument("--serve", action="store_true", help="keep the stack running after the script")
    parser.add_argument("--port", type=int, default=8000, help="gateway port with --serve")
    parser.add_argument("--tokenizer", default="builtin:demo")
    args = parser.parse_args(argv)
    servers: list[Server] = []
    try:
        # Answers longer than kv_recompute_threshold (64 tokens), so P reads them from D instead of recomputing.
        sim = ["--tokenizer", args.tokenizer, "--stream-kv-params", "--output-tokens", "80:120"]
        prefill = start(["sim", "--role", "prefill", "--engine-id", "demo-p", *sim])
        servers.append(prefill)
        decode = start(["sim", "--role", "decode", "--engine-id", "demo-d", *sim])
        servers.append(decode)
        gateway = start(["serve", "--prefill", prefill.url, "--decode", decode.url, "--tokenizer", args.tokenizer,
                         "--log-level", "warning", "--reuse-policy", "always"],   # show D's KV reused every turn
                        port=args.port if args.serve else 0)
        servers.append(gateway)
        print(f"gateway {gateway.url}  prefill {prefill.url}  decode {decode.url}  store: embedded\n")
        print_table(asyncio.run(script(gateway, prefill)))
        if args.serve:
            print(f"\nserving on {gateway.url} (Ctrl-C stops). Try:\n  curl -s {gateway.url}/v1/chat/completions "
                  "-H 'Content-Type: application/json' -H 'X-Session-Id: s1' "
                  "-d '{\"model\":\"demo\",\"messages\":[{\"role\":\"user\",\"content\":\"Hi\"}]}'")
            gateway.proc.wait()
    except KeyboardInterrupt:
        pass
    finally:
        for server in reversed(servers):
            server.stop()
