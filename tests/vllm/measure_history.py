"""Measure the two history modes on real vLLM: how often answers do not re-tokenize to the ids D generated, what
reuse each mode gets, and whether every turn stays exact against a co-located engine given the same prompt ids.
The evidence behind the default `history_tokens` (docs/vllm-findings.md, "Which history tokens"). Not a test:

    PYTHONPATH=$PWD .venv/bin/python tests/vllm/measure_history.py [--unconstrained] [--conversations 6]

Starts P, D and a co-located baseline for the tiny model (tests/vllm/make_model.py), one gateway per mode, and
runs the same conversations (fixed system lines, greedy) through each, JSON and streamed. Prints one JSON line
per turn, then a table per mode and transport.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from collections import defaultdict
from pathlib import Path

from gateway.turns.intake.generated import text_of
from gateway.turns.intake.render import Renderer
from tests.servers import Server, start
from tests.vllm.chat import Chat, Turn
from tests.vllm.conftest import HANDLE_TTL_MARGIN_S, ROOT
from tests.vllm.engines import PIN_TTL_S, Engine, launch, wait_healthy
from tests.vllm.test_pd import QUESTIONS

MODES = ("rendered", "generated")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--unconstrained", action="store_true")
    ap.add_argument("--conversations", type=int, default=6)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=80)
    args = ap.parse_args()
    model, engines = pd_and_baseline("pdgw-measure-", unconstrained=args.unconstrained)
    gateways: dict[str, Server] = {}
    try:
        wait_healthy(engines)
        for mode in MODES:
            gateways[mode] = start(["serve", "--tokenizer", str(model), "--prefill", engines[0].url,
                                    "--decode", engines[1].url, "--decoder-kv-blocks-ttl-s", str(PIN_TTL_S),
                                    "--handle-ttl-margin-s", str(HANDLE_TTL_MARGIN_S), "--history-tokens", mode])
        report(run(gateways, engines, Renderer(str(model)), args))
    finally:
        for server in gateways.values():
            server.stop()
        for engine in engines:
            engine.stop()


def pd_and_baseline(prefix: str, *, unconstrained: bool = False) -> tuple[Path, list[Engine]]:
    """The tier's tiny model in a fresh folder, and P, D and a co-located engine for it started (not yet
    healthy: `wait_healthy`)."""
    python = subprocess.run([str(ROOT / "scripts" / "vllm-env")], capture_output=True, text=True,
                            check=True).stdout.strip().splitlines()[-1]
    work = Path(tempfile.mkdtemp(prefix=prefix))
    model = work / "model"
    subprocess.run([python, str(ROOT / "tests/vllm/make_model.py"), str(model),
                    *(["--unconstrained"] if unconstrained else [])], check=True, capture_output=True)
    return model, [launch(python, model, role, name, work) for role, name in
                   (("prefill", "p0"), ("decode", "d0"), ("colocated", "baseline"))]


def run(gateways: dict[str, Server], engines: list[Engine], renderer: Renderer, args) -> list[dict]:
    rows = []
    for mode, gateway in gateways.items():
        for stream in (False, True):
            for n in range(args.conversations):
                chat = Chat(gateway, *engines, max_tokens=args.max_tokens, baseline_by_ids=True, messages=[
                    {"role": "system", "content": f"Conversation {n} ({mode}, stream={stream})."}])
                for i, question in enumerate(QUESTIONS[:args.turns]):
                    row = describe(chat.say(question, stream=stream), renderer)
                    rows.append({"mode": mode, "stream": stream, "conversation": n, "turn": i + 1, **row})
                    print(json.dumps(rows[-1]), flush=True)
    return rows


def describe(turn: Turn, renderer: Renderer) -> dict:
    ids = list(turn.token_ids)
    while ids and ids[-1] in renderer.special_ids:
        ids.pop()
    decoded = renderer.decode(ids)
    return {"plan": turn.plan, "reason": turn.reason, "reused": turn.reused, "p_read": turn.prefill_loaded,
            "p_computed": turn.prefill_computed, "prompt": len(turn.prompt_ids), "answer": len(turn.token_ids),
            "exact": turn.exact, "retokenizes": renderer.tokenizer.encode(turn.text, add_special_tokens=False) == ids,
            "partial_char": decoded != turn.text and text_of(decoded, turn.text),
            "other_text": not text_of(decoded, turn.text)}


def report(rows: list[dict]) -> None:
    cells: dict[tuple, list[dict]] = defaultdict(list)
    for row in rows:
        cells[row["mode"], "stream" if row["stream"] else "json"].append(row)
    print(f"\n{'mode':10} {'':6} {'answers':>7} {'not self':>8} {'cut char':>8} {'exact':>5} {'later':>5} "
          f"{'reuse':>5} {'read/turn':>9} {'computed/turn':>13} {'prompt/turn':>11}")
    for (mode, transport), cell in cells.items():
        later = [r for r in cell if r["turn"] > 1]
        print(f"{mode:10} {transport:6} {len(cell):7} {sum(not r['retokenizes'] for r in cell):8} "
              f"{sum(r['partial_char'] for r in cell):8} {sum(r['exact'] for r in cell):5} {len(later):5} "
              f"{sum(r['plan'] == 'reuse' for r in later):5} {mean(later, 'p_read'):9.1f} "
              f"{mean(later, 'p_computed'):13.1f} {mean(later, 'prompt'):11.1f}")


def mean(rows: list[dict], key: str) -> float:
    return sum(r[key] for r in rows) / max(1, len(rows))


if __name__ == "__main__":
    main()
