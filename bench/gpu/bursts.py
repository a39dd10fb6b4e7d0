"""Where a burst's first turns waited, from a gateway's text log (the turn lines' `seconds`, `p_ms`,
`d_first_ms` and their time stamps): each burst's first turns on one time line, from its first request.

    python bench/gpu/bursts.py /tmp/pdgw-gpu/G4.log [--min-size 4] [--window-s 0.3]

A burst: at least `--min-size` first turns that began within `--window-s` of the burst's first. A turn began at
its line's time less `seconds`; P answered `p_ms` later and D's first token `d_first_ms` after that (pull mode:
D's leg goes out as P answers; the gateway's own time before P's leg, a few ms, is left in)."""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from dataclasses import dataclass
from datetime import datetime

_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \S+ gateway\.turn turn (.*)$")


@dataclass(frozen=True)
class FirstTurn:
    began: float
    p_answered: float          # after `began`, seconds
    d_first: float             # after `began`, seconds
    d_first_ms: float


def turn_line(line: str) -> tuple[float, dict[str, str]] | None:
    """A gateway turn line's time stamp and `key=value` fields (telemetry.log_turn, text format); None: another line."""
    if not (m := _LINE.match(line)):
        return None
    ended = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
    return ended, dict(kv.split("=", 1) for kv in m.group(2).split() if "=" in kv)


def first_turns(lines: list[str]) -> list[FirstTurn]:
    out = []
    for line in lines:
        if (parsed := turn_line(line)) is None:
            continue
        ended, fields = parsed
        if fields.get("reason") != "first_turn" or "p_ms" not in fields or "d_first_ms" not in fields:
            continue
        p, d = float(fields["p_ms"]) / 1e3, float(fields["d_first_ms"]) / 1e3
        out.append(FirstTurn(ended - float(fields["seconds"]), p, p + d, float(fields["d_first_ms"])))
    return sorted(out, key=lambda t: t.began)


def bursts(turns: list[FirstTurn], min_size: int, window_s: float) -> list[list[FirstTurn]]:
    found, i = [], 0
    while i < len(turns):
        j = i
        while j < len(turns) and turns[j].began - turns[i].began <= window_s:
            j += 1
        if j - i >= min_size:
            found.append(turns[i:j])
            i = j
        else:
            i += 1
    return found


def row(burst: list[FirstTurn]) -> str:
    t0 = burst[0].began
    p = [(t.began - t0 + t.p_answered) * 1e3 for t in burst]
    d = [(t.began - t0 + t.d_first) * 1e3 for t in burst]
    after = [x - max(p) for x in d]
    return (f"| {len(burst)} | {min(p):.0f}-{max(p):.0f} | {min(d):.0f}-{max(d):.0f} | "
            f"{min(after):+.0f} to {max(after):+.0f} | {statistics.median(t.d_first_ms for t in burst):.0f} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log")
    ap.add_argument("--min-size", type=int, default=4)
    ap.add_argument("--window-s", type=float, default=0.3)
    args = ap.parse_args(argv)
    with open(args.log, errors="replace") as f:
        found = bursts(first_turns(f.readlines()), args.min_size, args.window_s)
    print("| first turns | P answered (ms) | D's first tokens (ms) | first tokens after P's last answer "
          "| `d_first_ms` p50 |\n|---|---|---|---|---|")
    for burst in found:
        print(row(burst))
    return 0 if found else 1


if __name__ == "__main__":
    sys.exit(main())
