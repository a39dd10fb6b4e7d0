"""Warm turns the short way (issue 24), side by side in one run on simulated engines with a GPU-like cost model:
a conversation's second turn, by history (4k, 32k tokens) and new suffix (16 to 4k tokens), through
- `local`: pd-gateway with the local path for every suffix size (the holder D computes the suffix itself);
- `P reads`: pd-gateway with the local path off (P reads D's KV and computes the suffix, D reads P's new blocks);
- `stateless PD`: pd-gateway without session ids nor prefix lookup (P prefills; its own prefix cache is warm);
- `one engine`: a co-located engine with its prefix cache, no gateway;
then D's inter-token latency (p50/p99) of 8 running streams while local turns arrive, against the same streams
with no local turns (D's steps are shared: `--batched-steps`).

    python bench/local.py            # 4 repetitions, writes its section into bench/RESULTS.md and bench/local.png
    python bench/local.py --quick    # 2 repetitions, 4k and 32k histories
    python bench/local.py --smoke    # tiny sizes for the test suite; --out - writes nothing

The timing model (flags below) is an H200's for the bench's 2.8 B model: prefill 50k tokens/s, decode 8 ms a
step, KV moved at 16 tokens per 0.05 ms with a fixed 40 ms per read (D's leg after P took 50-73 ms on the H200,
bench/GPU-RESULTS.md). Steps are additive (decode step + prefill tokens): an upper bound on what a local
prefill costs the streams; the H200 run (bench/gpu/) measures it. Last line:
    local: ttft_vs_one_engine_4k=A ttft_vs_one_engine_32k=B stateless_vs_local_32k=C p_reads_vs_local_32k=D
           itl_p99_ratio=E itl_p50_ratio=F corrupt=N
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import random
import statistics
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import msgspec

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.agent_loop import record  # noqa: E402
from bench.loadgen import percentile  # noqa: E402
from bench.servers import Servers, get_json  # noqa: E402

SECTION = "## 11. Warm turns the short way: the local path (`bench/local.py`)"
TIMING = ["--prefill-ms-per-token", "0.02", "--decode-ms-per-token", "8", "--transfer-ms-per-block", "0.05",
          "--transfer-ms-per-read", "40"]
ENGINE = ["--num-blocks", "40000", "--max-model-len", "65536", "--stream-kv-params", "--output-tokens", "16:16"]
VOCAB = range(300, 3800)
ARMS = ("local", "P reads", "stateless PD", "one engine")
STREAMS, STREAM_TOKENS = 8, 300


def k(tokens: int) -> str:
    return f"{tokens / 1024:g}k"


@dataclass(frozen=True)
class Sizes:
    histories: tuple[int, ...]
    suffixes: tuple[int, ...]
    reps: int
    local_suffix: int          # the suffix of the local turns arriving during the ITL run
    local_every_s: float


FULL = Sizes((4096, 32768), (16, 64, 256, 1024, 4096), 4, 256, 0.1)
QUICK = Sizes((4096, 32768), (16, 64, 256, 1024, 4096), 2, 256, 0.1)
SMOKE = Sizes((512,), (16, 256), 1, 64, 0.1)
_encode, _decode = msgspec.json.encode, msgspec.json.decode


class Client:
    """Token-id completions, streamed, on one aiohttp session: TTFT is the first event with an answer token."""

    def __init__(self, http: aiohttp.ClientSession) -> None:
        self.http = http

    async def turn(self, url: str, ids: list[int], max_tokens: int, session: str | None = None) -> tuple[
            float, list[int], dict[str, str]]:
        body = {"model": "demo", "prompt": ids, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
                "return_token_ids": True}
        headers = {"Content-Type": "application/json", **({"X-Session-Id": session} if session else {})}
        began, first, out = time.perf_counter(), None, []
        async with self.http.post(url + "/v1/completions", data=_encode(body), headers=headers) as resp:
            resp.raise_for_status()
            async for line in resp.content:
                if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                    continue
                for choice in _decode(line[6:]).get("choices") or ():
                    if choice.get("token_ids"):
                        first = first or time.perf_counter()
                        out += choice["token_ids"]
            headers_out = {k.lower(): v for k, v in resp.headers.items() if k.lower().startswith("x-pd-")}
        return (first or time.perf_counter()) - began, out, headers_out

    async def gaps(self, url: str, ids: list[int], tokens: int) -> list[float]:
        """One long stream straight at an engine: the time between its tokens."""
        body = {"model": "demo", "prompt": ids, "max_tokens": tokens, "ignore_eos": True, "stream": True}
        stamps = []
        async with self.http.post(url + "/v1/completions", data=_encode(body),
                                  headers={"Content-Type": "application/json"}) as resp:
            async for line in resp.content:
                if line.startswith(b"data: {"):
                    stamps.append(time.perf_counter())
        return [b - a for a, b in zip(stamps, stamps[1:])]


def ids(rng: random.Random, n: int) -> list[int]:
    return [rng.choice(VOCAB) for _ in range(n)]


async def second_turn(client: Client, arm: str, urls: dict[str, str], history: int, suffix: int,
                      rng: random.Random) -> tuple[float, str]:
    """A new conversation's first turn, then the timed second: (TTFT, the plan the gateway reported)."""
    session = None if arm == "stateless PD" else uuid.uuid4().hex
    first = ids(rng, history)
    _, out, _ = await client.turn(urls[arm], first, 16, session)
    ttft, _, headers = await client.turn(urls[arm], first + out + ids(rng, suffix), 4, session)
    return ttft, headers.get("x-pd-plan", "-")


async def ttft_grid(urls: dict[str, str], engines: list[str],
                    sizes: Sizes) -> dict[tuple[str, int, int], tuple[float, set[str]]]:
    rng, grid = random.Random(24), {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
        client = Client(http)
        for history in sizes.histories:
            for suffix in sizes.suffixes:
                for url in engines:          # each size on empty engines: earlier sizes' pins would crowd D
                    async with http.post(url + "/sim/reset", data=b"{}") as resp:
                        resp.raise_for_status()
                for arm in ARMS:             # arms take turns within each size: drift hits all alike
                    runs = [await second_turn(client, arm, urls, history, suffix, rng) for _ in range(sizes.reps)]
                    grid[(arm, history, suffix)] = (statistics.median(t for t, _ in runs), {p for _, p in runs})
    return grid


async def itl(urls: dict[str, str], d_url: str, sizes: Sizes, with_local: bool) -> list[float]:
    """ITL of STREAMS streams on D; `with_local`: local turns (warmed conversations) arrive meanwhile."""
    rng = random.Random(7)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
        client = Client(http)
        warm = []
        if with_local:
            for _ in range(12):
                session, first = uuid.uuid4().hex, ids(rng, 1024)
                _, out, _ = await client.turn(urls["local"], first, 16, session)
                warm.append((session, first + out))
        streams = [asyncio.ensure_future(client.gaps(d_url, ids(rng, 256), STREAM_TOKENS)) for _ in range(STREAMS)]
        await asyncio.sleep(0.3)                     # all running
        for session, held in warm:
            if all(s.done() for s in streams):
                break
            await client.turn(urls["local"], held + ids(rng, sizes.local_suffix), 1, session)
            await asyncio.sleep(sizes.local_every_s)
        gaps = [g for s in await asyncio.gather(*streams) for g in s[2:]]     # past the streams' own prefill
    return gaps


def run(sizes: Sizes) -> dict[str, Any]:
    with Servers() as servers:
        flags = [*ENGINE, *TIMING, "--batched-steps"]
        p, d, c = servers.sims([("prefill", "lp0", flags), ("decode", "ld0", flags), ("colocated", "lc0", flags)])
        local, p_reads, stateless = servers.gateways([
            ([p], [d], ["--local-prefill-max-tokens", "1000000"]),
            ([p], [d], ["--local-prefill-max-tokens", "0"]),
            ([p], [d], ["--conversation-lookup", "session"])])
        urls = {"local": local.url, "P reads": p_reads.url, "stateless PD": stateless.url, "one engine": c.url}
        grid = asyncio.run(ttft_grid(urls, [p.url, d.url, c.url], sizes))
        quiet, busy = [], []
        for _ in range(2):                   # alone and with local turns, taking turns: A B A B
            quiet += asyncio.run(itl(urls, d.url, sizes, with_local=False))
            busy += asyncio.run(itl(urls, d.url, sizes, with_local=True))
        corrupt = sum(get_json(e.url + "/sim/stats")["kv_reads_corrupt"] for e in (p, d, c))
    return {"grid": grid, "quiet": quiet, "busy": busy, "corrupt": corrupt}


def report(result: dict[str, Any], sizes: Sizes, seconds: float) -> tuple[str, str]:
    grid = result["grid"]
    ms = {key: value[0] * 1e3 for key, value in grid.items()}
    lines = [SECTION, "", "![later-turn TTFT by new suffix, per history](local.png)", "",
             f"Run {datetime.date.today()}, {seconds:.0f} s, {sizes.reps} repetitions (medians), simulated engines "
             f"with the H200-like timing `{' '.join(TIMING)}` and `--batched-steps`. Later-turn TTFT (ms) of a "
             "conversation's second turn by history and new suffix; `local` is pd-gateway with the local path for "
             "every size (its default bound is 256 tokens), `P reads` with it off:", "",
             "| history | suffix | " + " | ".join(ARMS) + " | local / one engine | stateless / local | plans |",
             "|---|---|" + "---|" * (len(ARMS) + 3)]
    for history in sizes.histories:
        for suffix in sizes.suffixes:
            row = [ms[(arm, history, suffix)] for arm in ARMS]
            plans = "; ".join(f"{arm}: {','.join(sorted(grid[(arm, history, suffix)][1]))}" for arm in ARMS[:3])
            lines.append(f"| {k(history)} | {suffix} | " + " | ".join(f"{v:.1f}" for v in row) +
                         f" | {row[0] / row[3]:.2f} | {row[2] / row[0]:.2f} | {plans} |")
    quiet, busy = result["quiet"], result["busy"]
    p50 = (percentile(quiet, 50) * 1e3, percentile(busy, 50) * 1e3)
    p99 = (percentile(quiet, 99) * 1e3, percentile(busy, 99) * 1e3)
    lines += ["", f"D's inter-token latency, {STREAMS} streams of {STREAM_TOKENS} tokens: alone p50 {p50[0]:.1f} ms, "
              f"p99 {p99[0]:.1f} ms; with a local turn of {sizes.local_suffix} new tokens every "
              f"{sizes.local_every_s * 1e3:.0f} ms p50 {p50[1]:.1f} ms, p99 {p99[1]:.1f} ms "
              f"(p99 {p99[1] / p99[0]:.2f}x). The steps are additive here (a step lasts its decode plus its prefill "
              "tokens), the worst case; the H200 run measures the real cost.", "",
              f"Corrupt KV reads (the simulator's oracle): {result['corrupt']}.", ""]
    big = max(sizes.histories)
    short = min(sizes.suffixes)
    ratios = {f"ttft_vs_one_engine_{k(h)}": ms[("local", h, short)] / ms[("one engine", h, short)]
              for h in sizes.histories}
    summary = ("local: " + " ".join(f"{k}={v:.2f}" for k, v in ratios.items()) +
               f" stateless_vs_local_{k(big)}={ms[('stateless PD', big, short)] / ms[('local', big, short)]:.2f}"
               f" p_reads_vs_local_{k(big)}={ms[('P reads', big, short)] / ms[('local', big, short)]:.2f}"
               f" itl_p99_ratio={p99[1] / p99[0]:.2f} itl_p50_ratio={p50[1] / p50[0]:.2f}"
               f" corrupt={result['corrupt']}")
    return "\n".join(lines) + "\n", summary


def plot(result: dict[str, Any], sizes: Sizes, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(sizes.histories), figsize=(5.5 * len(sizes.histories), 4), squeeze=False)
    for ax, history in zip(axes[0], sizes.histories):
        for arm in ARMS:
            ax.plot(sizes.suffixes, [result["grid"][(arm, history, n)][0] * 1e3 for n in sizes.suffixes], "o-",
                    label=arm)
        ax.axvline(256, color="grey", linestyle=":", label="default local bound")
        ax.set(xscale="log", xlabel="new suffix (tokens)", ylabel="later-turn TTFT (ms)",
               title=f"{k(history)} tokens of history (simulated H200)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "bench" / "RESULTS.md"), help="'-': nowhere")
    args = ap.parse_args(argv)
    sizes = SMOKE if args.smoke else QUICK if args.quick else FULL
    began = time.perf_counter()
    result = run(sizes)
    text, summary = report(result, sizes, time.perf_counter() - began)
    if args.out != "-":
        record(Path(args.out), text, SECTION)
        plot(result, sizes, Path(args.out).parent / "local.png")
    print(text)
    print(summary)
    return summary


if __name__ == "__main__":
    main()
