"""Where the gateway's CPU goes: py-spy samples the gateway process while compare.py's loads run through it, on
zero-timing simulated engines and a real Redis, and the samples are summed per function (inclusive and self).

    python bench/profile.py [--load chat|sessionless|stream|history] [--tree DIR] [--out DIR] [--top 60]

Loads: `chat` (compare.py's phase 1: 64 conversations at once, 4 turns, think time 0-2 s), `sessionless` (the
same without session ids: the prefix lookup), `stream` (8 at once, answers of 1,000 tokens), `history` (4 at
once, 6 turns, a 32k-token system prompt, engines using pinned ids). Writes DIR/profile-LOAD.raw (py-spy's raw
format: one `frame;frame;... count` line per stack) and prints the table; `--from RAW` prints the table of a raw
file made elsewhere (the 16-core host: bench/host/run.sh profile). py-spy needs ptrace rights on the gateway
(it runs as the same user here).
"""

from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.ab import gateway  # noqa: E402
from bench.compare import GATEWAY_TTL, PINNED_SIM, ZERO_SIM, drive  # noqa: E402
from bench.loadgen import OpenAITarget  # noqa: E402
from bench.servers import Servers  # noqa: E402
from bench.streaming import STREAM_SIM  # noqa: E402
from bench.workload import Workload  # noqa: E402

CHAT = Workload(conversations=64, turns=4, new_tokens=48, think_s=1.0, seed=1)
LOADS = {  # name: (engine flags, workload, concurrency, rounds)
    "chat": (ZERO_SIM, CHAT, 64, 3),
    "sessionless": (ZERO_SIM, replace(CHAT, sessions=False), 64, 3),
    "stream": (STREAM_SIM, Workload(conversations=8, turns=2, new_tokens=48, seed=5), 8, 2),
    "history": (PINNED_SIM, Workload(conversations=4, turns=6, new_tokens=48, history_tokens=32000, seed=7), 4, 2),
}


def py_spy() -> str:
    found = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(found).exists():
        sys.exit("py-spy not found: pip install py-spy")
    return found


def record(load: str, tree: str, raw: Path) -> None:
    sim, w, concurrency, rounds = LOADS[load]
    with Servers() as s:
        redis = s.redis()
        p, d = s.sims([("prefill", "p0", sim), ("decode", "d0", sim)])
        gw = gateway(s, tree, sys.executable, [p], [d], ["--redis-url", redis.url, *GATEWAY_TTL])
        target = OpenAITarget(gw.url)
        drive(target, replace(w, conversations=min(8, w.conversations), turns=2, think_s=0.0, seed=99),
              concurrency=min(8, concurrency))                          # warm: tokenizer, connections, caches
        spy = subprocess.Popen([py_spy(), "record", "-p", str(gw.proc.pid), "-o", str(raw), "-f", "raw",
                                "-r", "200", "--nonblocking"], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        time.sleep(1.0)                                                 # py-spy attaches
        for seed in range(rounds):
            drive(target, replace(w, seed=w.seed + seed), concurrency=concurrency)
        spy.send_signal(2)
        spy.wait(timeout=30)


def _frame(frame: str) -> str:
    """`func (path:line)` less the line and the site-packages prefix: one row per function."""
    frame = re.sub(r":\d+\)$", ")", frame)
    return re.sub(r"\(/\S*/(site-packages|lib/python3\.\d+)/", "(", frame).replace(str(ROOT) + "/", "")


def table(raw: Path, top: int, pattern: str = "") -> str:
    inclusive, own, total = collections.Counter(), collections.Counter(), 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        n, frames = int(count), [_frame(f) for f in stack.split(";")]
        total += n
        for f in set(frames):
            inclusive[f] += n
        own[frames[-1]] += n
    rows = [f"{raw.name}: {total} samples", "| inclusive % | self % | function |", "|---|---|---|"]
    for f, n in inclusive.most_common():
        if len(rows) - 3 >= top:
            break
        if pattern in f:
            rows.append(f"| {100 * n / total:.1f} | {100 * own[f] / total:.1f} | `{f}` |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--load", choices=sorted(LOADS), default="chat")
    ap.add_argument("--tree", default=str(ROOT), help="the source tree whose gateway runs (default: this one)")
    ap.add_argument("--out", default=tempfile.gettempdir())
    ap.add_argument("--top", type=int, default=60)
    ap.add_argument("--match", default="", help="only rows whose function contains this")
    ap.add_argument("--from", dest="raw", help="print the table of this raw file; record nothing")
    args = ap.parse_args(argv)
    raw = Path(args.raw) if args.raw else Path(args.out) / f"profile-{args.load}.raw"
    if not args.raw:
        record(args.load, args.tree, raw)
    print(table(raw, args.top, args.match))


if __name__ == "__main__":
    main()
