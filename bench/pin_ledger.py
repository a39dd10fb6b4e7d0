"""The pin ledger's work per turn by the number of stored handles, side by side in one run: the ledger
(gateway/turns/state/pins.py: per-D totals, insertion order, an expiry heap) vs a pass over every pin per turn, as the
ledger was before (kept here as `EveryPin`, also the oracle of tests/unit/test_pin_ledger.py).

    python bench/pin_ledger.py [--turns 400] [--out bench/RESULTS.md | -]

In process: N handles stored on one D (plus N/4 on another), then turns as ConversationState makes them: claim
a handle, mark it spent, admit and store the new one, read the totals for the gauge and routing. Two budgets:
`room` (nothing evicted) and `full` (every admit evicts the oldest idle handle). CPU per turn, median of 5
repetitions. Last line:
    pin_ledger: ms_1k=X every_pin_ms_1k=Y ratio_10k=Z
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.agent_loop import record  # noqa: E402
from gateway.store import ConversationKey  # noqa: E402
from gateway.turns.state.budget import Decision, Pin, PinBudget  # noqa: E402
from gateway.turns.state.pins import PinLedger, Victim  # noqa: E402

SECTION = "## 8. Pin ledger work per turn by stored handles (`bench/pin_ledger.py`)"
BS = 16
TOKENS = 2000
SIZES = (100, 1_000, 10_000)


class EveryPin:
    """The ledger before issue 16's review: one dict, and every turn a pass (and a sort) over all pins."""

    def __init__(self, budget: PinBudget) -> None:
        self.budget = budget
        self._pins: dict[ConversationKey, dict] = {}

    def claim(self, key: ConversationKey, now: float) -> None:
        if (entry := self._pins.get(key)) is not None:
            entry.update(claimed=True, last_used=now)

    def drop(self, key: ConversationKey) -> None:
        self._pins.pop(key, None)

    def spent(self, key: ConversationKey) -> None:
        if (entry := self._pins.get(key)) is not None and entry["claimed"]:
            del self._pins[key]

    def admit(self, engine: str, key: ConversationKey, tokens: int, num_gpu_blocks: int | None,
              now: float) -> tuple[Decision, list[Victim]]:
        self._expire(now)
        on = {k: e for k, e in self._pins.items() if e["engine"] == engine}
        decision = self.budget.admit([Pin(k, e["tokens"], e["last_used"], e["claimed"]) for k, e in on.items()],
                                     key, tokens, num_gpu_blocks)
        victims = [Victim(k, on[k]["turn"], engine) for k in decision.release]
        for victim in victims:
            self.drop(victim.key)
        return decision, victims

    def put(self, engine: str, key: ConversationKey, turn: int, tokens: int, now: float, expires_at: float) -> None:
        self._pins[key] = {"engine": engine, "turn": turn, "tokens": tokens, "last_used": now,
                           "expires_at": expires_at, "claimed": False}

    def pinned_tokens(self, engine: str) -> int:
        return sum(e["tokens"] for e in self._pins.values() if e["engine"] == engine)

    def pinned_blocks(self, engine: str) -> int:
        return self.budget.pinned_blocks(Pin(k, e["tokens"], 0) for k, e in self._pins.items() if e["engine"] == engine)

    def _expire(self, now: float) -> None:
        for key in [k for k, e in self._pins.items() if e["expires_at"] <= now]:
            del self._pins[key]


def per_turn_ms(kind: type, n: int, capacity_blocks: int, turns: int) -> float:
    """CPU ms per turn of a ledger holding `n` handles on d0 (and n/4 on d1) while turns go round them."""
    ledger = kind(PinBudget(1.0, BS))
    now = 1_000.0
    keys = [ConversationKey("t", f"c{i}") for i in range(n)]
    for i, key in enumerate(keys):
        ledger.put("d0", key, 1, TOKENS, now + i * 1e-6, now + 10_000)
    for i in range(n // 4):
        ledger.put("d1", ConversationKey("t", f"o{i}"), 1, TOKENS, now, now + 10_000)
    began, evicted = time.process_time(), 0
    for t in range(turns):
        key, now = keys[t % n], now + 1e-3
        ledger.claim(key, now)
        ledger.spent(key)
        decision, victims = ledger.admit("d0", key, TOKENS, capacity_blocks, now)
        evicted += len(victims)
        if decision.keep_new:
            ledger.put("d0", key, t + 2, TOKENS, now, now + 10_000)
        ledger.pinned_tokens("d0")
        ledger.pinned_blocks("d0")
    ms = (time.process_time() - began) * 1e3 / turns
    assert (evicted > 0) == (capacity_blocks < n * -(-TOKENS // BS)), "the budget did not act as its name says"
    return ms


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=400)
    ap.add_argument("--out", default=str(ROOT / "bench" / "RESULTS.md"), help="'-': nowhere")
    args = ap.parse_args(argv)
    blocks_per_pin = -(-TOKENS // BS)
    rows, ms = [], {}
    for n in SIZES:           # full: n - 1 handles fit, so storing a turn's new one evicts the oldest idle one
        for budget, capacity in (("room", 2 * n * blocks_per_pin), ("full", (n - 1) * blocks_per_pin)):
            for name, kind in (("ledger", PinLedger), ("every pin", EveryPin)):
                ms[(n, budget, name)] = statistics.median(per_turn_ms(kind, n, capacity, args.turns)
                                                          for _ in range(5))
            ratio = ms[(n, budget, "every pin")] / ms[(n, budget, "ledger")]
            rows.append(f"| {n:,} | {budget} | {ms[(n, budget, 'ledger')]:.4f} | {ms[(n, budget, 'every pin')]:.4f} "
                        f"| {ratio:.0f}x |")
    final = (f"pin_ledger: ms_1k={ms[(1_000, 'full', 'ledger')]:.4f} "
             f"every_pin_ms_1k={ms[(1_000, 'full', 'every pin')]:.4f} "
             f"ratio_10k={ms[(10_000, 'full', 'every pin')] / ms[(10_000, 'full', 'ledger')]:.0f}")
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    section = "\n".join([
        SECTION, "",
        f"In process; N handles of {TOKENS} tokens on one D (and N/4 on another), {args.turns} turns going round "
        "them (claim, spent, admit, store, the totals); `room`: nothing evicted, `full`: every admit evicts the "
        f"oldest idle handle. CPU ms per turn, median of 5. {when}, load average {load}.", "",
        "| stored handles | budget | ledger ms/turn | every pin ms/turn | ratio |", "|---|---|---|---|---|",
        *rows, "", "```", final, "```", ""])
    if args.out != "-":
        record(Path(args.out), section, SECTION)
    print(section)
    return final


if __name__ == "__main__":
    print(main())
