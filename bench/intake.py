"""Intake's CPU per turn by history, side by side in one run: continued (messages found by their bytes, the
prompt's ids continued from the conversation's previous prompt) vs whole (both caches off: every message
decoded, the whole prompt cut and its pieces looked up, as before issue 16). Issue 16 item 1.

    python bench/intake.py [--conversations 12] [--turns 6] [--rounds 3] [--out bench/RESULTS.md | -]

In process, no engines: per turn, what the gateway does with a chat request before and around its legs:
`parse` (api/schemas.py), `render` (Intake.chat: template, encoding, context checks), `generated` (the prompt
again with past answers as D's ids, history_tokens "generated"), `legs` (both legs' bodies encoded as sent).
CPU (process time) per turn over turns >= 2, mean of the rounds' means; the modes and histories take turns
within each round. Two shapes of history: one long system prompt (1k vs 32k tokens, as compare.py's section 2)
and many messages (11 vs 301 messages of ~100 tokens). Writes its section into RESULTS.md (after compare.py,
which rewrites the file). Then Responses API turns that continue `previous_response_id` over a 1k vs 32k-token
history (the first turn's input): `parse` (the Responses body, its chat body, api/schemas.py), `continue` (the
stored response loaded from the embedded store, its ids from this process's cache, and the new items rendered at
the template's boundary: turns/intake/continued.py), `legs` as above; intake = parse + continue. Last line:
    intake: cpu_32k_vs_1k=X whole_cpu_32k_vs_1k=Y ms_32k=A whole_ms_32k=B many_vs_few=C whole_many_vs_few=D
        responses_cpu_32k_vs_1k=E responses_ms_32k=F responses_nogc_32k_vs_1k=G
(G: with the garbage collector off while those turns run. `--only responses`: that part alone, its own last
line `intake: responses_...`.)
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import random
import statistics
import sys
import time
from pathlib import Path

import msgspec

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.agent_loop import record  # noqa: E402
from bench.workload import words  # noqa: E402
import asyncio  # noqa: E402

from gateway.api import responses as responses_api  # noqa: E402
from gateway.api.schemas import ChatRequest, parse  # noqa: E402
from gateway.store import MemoryConversationStore  # noqa: E402
from gateway.telemetry import Metrics  # noqa: E402
from gateway.turns.intake.continued import Continuation  # noqa: E402
from gateway.turns.legs.capture import DecodeCapture  # noqa: E402
from gateway.turns.state.stored_responses import StoredResponses  # noqa: E402
from gateway.engines.client import _encode  # noqa: E402
from gateway.turns.intake.generated import answer, remember  # noqa: E402
from gateway.turns.intake.intake import Intake  # noqa: E402
from gateway.turns.legs.bodies import decode_body, prefill_body  # noqa: E402
from gateway.turns.intake.message_cache import MessageCache  # noqa: E402
from gateway.turns.intake.render import Renderer  # noqa: E402

STAGES = ("parse", "render", "generated", "legs")
SHAPES = {"1k": (1000, 0), "32k": (32000, 0), "11 msgs": (0, 5), "301 msgs": (0, 150)}
NEW_TOKENS = 48


class Mode:
    def __init__(self, continued: bool) -> None:
        self.renderer = Renderer("builtin:demo", prefix_bytes=256 << 20 if continued else 0)
        self.intake = Intake(self.renderer, ["demo"], max_model_len=1 << 20)
        self.cache = MessageCache() if continued else MessageCache(max_bytes=0)


def run(mode: Mode, shape: str, conversations: int, turns: int, seed: int) -> dict[str, float]:
    """Mean CPU ms per turn and stage over turns >= 2 of `conversations` conversations taking turns."""
    system_tokens, pairs = SHAPES[shape]
    rng = random.Random(seed)
    tokenize = mode.renderer.tokenizer
    chats = []
    for c in range(conversations):
        messages = [{"role": "system", "content": f"conversation {seed}-{c}. " + words(rng, system_tokens)}]
        answers = []
        for _ in range(pairs):
            text = words(rng, 100)
            messages += [{"role": "user", "content": words(rng, 100)}, {"role": "assistant", "content": text}]
            answers = remember(answers, answer(text, tokenize.encode(text, add_special_tokens=False)))
        chats.append((messages, answers))
    spent = {stage: [] for stage in STAGES}
    clock = time.process_time
    for turn in range(turns):
        for messages, answers in chats:
            messages.append({"role": "user", "content": words(rng, NEW_TOKENS)})
            raw = msgspec.json.encode({"model": "demo", "messages": messages, "stream": True, "max_tokens": 64})
            t0 = clock()
            body, req = parse(raw, ChatRequest, cache=mode.cache)
            t1 = clock()
            request = mode.intake.chat(body, req, "bench")
            t2 = clock()
            if answers:
                request.prompt_ids = request.rerender(answers)
            t3 = clock()
            _encode(prefill_body(request, None))
            _encode(decode_body(request, None))
            t4 = clock()
            if turn >= 1:
                for stage, seconds in zip(STAGES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                    spent[stage].append(seconds * 1e3)
            text = words(rng, NEW_TOKENS)     # D's answer: its ids as the tokenizer gives them
            answers[:] = remember(answers, answer(text, tokenize.encode(text, add_special_tokens=False)))
            messages.append({"role": "assistant", "content": text})
    return {stage: statistics.fmean(values) for stage, values in spent.items()}


SECTION = "## 7. Intake CPU per turn by history (`bench/intake.py`)"
RESPONSE_STAGES = ("parse", "continue", "legs")
RESPONSE_SHAPES = {"1k": 1000, "32k": 32000}


def responses_run(mode: Mode, shape: str, conversations: int, turns: int, seed: int) -> dict[str, float]:
    """Mean CPU ms per previous_response_id turn and stage over turns >= 2: as the handler runs them
    (api/responses_routes.py), the previous response loaded from the embedded store."""
    rng = random.Random(seed)
    continuation, tokenize = Continuation(mode.intake), mode.renderer.tokenizer
    stored = StoredResponses(MemoryConversationStore(), Metrics())
    loop = asyncio.new_event_loop()
    previous_ids: list[str | None] = [None] * conversations
    spent = {stage: [] for stage in RESPONSE_STAGES}
    clock = time.process_time
    for turn in range(turns):
        for c in range(conversations):
            text = words(rng, RESPONSE_SHAPES[shape]) if turn == 0 else words(rng, NEW_TOKENS)
            raw = msgspec.json.encode({"model": "demo", "instructions": f"conversation {seed}-{c}. Be brief.",
                                       "input": text, "stream": True, "max_output_tokens": 64,
                                       "previous_response_id": previous_ids[c]})
            t0 = clock()
            req = responses_api.parse_request(raw)
            body, parsed = parse(msgspec.json.encode(responses_api.chat_body(req, "demo")), ChatRequest,
                                 cache=mode.cache)
            t1 = clock()
            previous = loop.run_until_complete(stored.load("bench", req.previous_response_id)) \
                if req.previous_response_id else None
            request, thread = continuation.turn(previous, req.instructions, body, parsed, "bench")
            t2 = clock()
            _encode(prefill_body(request, None))
            _encode(decode_body(request, None))
            t3 = clock()
            if turn >= 1:
                for stage, seconds in zip(RESPONSE_STAGES, (t1 - t0, t2 - t1, t3 - t2)):
                    spent[stage].append(seconds * 1e3)
            answer_text = words(rng, NEW_TOKENS)           # D's answer, its ids as the tokenizer gives them
            output = [*tokenize.encode(answer_text, add_special_tokens=False), tokenize.eos_token_id]
            capture = DecodeCapture(prompt_ids=request.prompt_ids, output_ids=output, output_ids_seen=True,
                                    finish_reason="stop", text=[answer_text])
            response_id = responses_api.new_id("resp")
            loop.run_until_complete(stored.save("bench", response_id, previous.session if previous else response_id,
                                                request, thread, capture, b"{}"))
            previous_ids[c] = response_id
        if turn == 0:
            gc.collect()     # the first turns' 32k-token inputs, collected before measuring, not in a later turn
    loop.close()
    return {stage: statistics.fmean(values) for stage, values in spent.items()}


def responses_report(table: dict[str, dict[str, float]]) -> tuple[list[str], str]:
    def intake(shape: str) -> float:
        return table[shape]["parse"] + table[shape]["continue"]

    lines = ["", "Responses API turns continuing `previous_response_id` (CPU ms per turn over turns >= 2; intake = "
             "parse + continue):", "",
             "| history | " + " | ".join(f"{s} ms" for s in RESPONSE_STAGES) + " | intake ms |",
             "|---|" + "---|" * (len(RESPONSE_STAGES) + 1)]
    for shape, stages in table.items():
        lines.append(f"| {shape} | " + " | ".join(f"{stages[s]:.3f}" for s in RESPONSE_STAGES)
                     + f" | {intake(shape):.3f} |")
    final = (f"responses_cpu_32k_vs_1k={intake('32k') / intake('1k'):.3f} responses_ms_32k={intake('32k'):.3f} "
             f"responses_nogc_32k_vs_1k={intake('32k, collector off') / intake('1k, collector off'):.3f}")
    lines += ["", "`collector off`: the same turns with Python's garbage collector disabled while they run. A turn's "
              "own intake work does not grow with the history (nothing of it is copied, decoded or encoded again: "
              "tests/unit/test_continued.py); what differs is the collector and the caches, evicted by the same "
              "turns' O(history) copies after intake (the legs' JSON, the stored response): `parse`, the same "
              "work at both lengths, differs alike."]
    return lines, final


def report(table: dict[tuple[str, str], dict[str, float]], args: argparse.Namespace) -> tuple[str, str]:
    def total(name: str, shape: str) -> float:
        return sum(table[(name, shape)].values())

    lines = [SECTION, "",
             f"In process, no engines; {args.conversations} conversations taking turns, {args.turns} turns, "
             f"{args.rounds} rounds; CPU ms per turn over turns >= 2. `continued`: messages found by their bytes, "
             "the prompt continued from the conversation's previous one (issue 16); `whole`: both caches off. "
             f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, load average "
             f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} at the end.", "",
             "| mode | history | " + " | ".join(f"{s} ms" for s in STAGES) + " | total ms |",
             "|---|---|" + "---|" * (len(STAGES) + 1)]
    for (name, shape), stages in table.items():
        lines.append(f"| {name} | {shape} | " + " | ".join(f"{stages[s]:.3f}" for s in STAGES)
                     + f" | {sum(stages.values()):.3f} |")
    final = (f"intake: cpu_32k_vs_1k={total('continued', '32k') / total('continued', '1k'):.3f} "
             f"whole_cpu_32k_vs_1k={total('whole', '32k') / total('whole', '1k'):.3f} "
             f"ms_32k={total('continued', '32k'):.3f} whole_ms_32k={total('whole', '32k'):.3f} "
             f"many_vs_few={total('continued', '301 msgs') / total('continued', '11 msgs'):.3f} "
             f"whole_many_vs_few={total('whole', '301 msgs') / total('whole', '11 msgs'):.3f}")
    lines += ["", "```", final, "```", ""]
    return "\n".join(lines), final


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=12)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", choices=["responses"], help="run only the Responses API part (prints, writes nothing)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "RESULTS.md"), help="'-': nowhere")
    args = ap.parse_args(argv)
    modes = {"continued": Mode(True), "whole": Mode(False)}
    by_shape: dict[str, list[dict[str, float]]] = {}
    for collector in (True, False):
        for round_ in range(args.rounds):
            for shape in RESPONSE_SHAPES:
                if not collector:
                    gc.disable()
                try:
                    result = responses_run(modes["continued"], shape, args.conversations, args.turns, 1000 + round_)
                finally:
                    gc.enable()
                by_shape.setdefault(shape if collector else f"{shape}, collector off", []).append(result)
    responses = {shape: {stage: statistics.fmean(r[stage] for r in rounds) for stage in RESPONSE_STAGES}
                 for shape, rounds in by_shape.items()}
    response_lines, response_final = responses_report(responses)
    if args.only == "responses":
        print("\n".join(response_lines))
        print(f"intake: {response_final}")
        return response_final
    results: dict[tuple[str, str], list[dict[str, float]]] = {}
    for round_ in range(args.rounds):
        for shape in SHAPES:
            for name, mode in modes.items():
                seed = round_ * 100 + list(SHAPES).index(shape)
                results.setdefault((name, shape), []).append(run(mode, shape, args.conversations, args.turns, seed))
    table = {key: {stage: statistics.fmean(r[stage] for r in rounds) for stage in STAGES}
             for key, rounds in sorted(results.items(), key=lambda kv: list(SHAPES).index(kv[0][1]))}
    text, final = report(table, args)
    final = f"{final} {response_final}"
    text = text.replace("```\n", "", 1).rsplit("```", 1)[0].rstrip().rsplit("\n", 1)[0]     # the block goes last
    text = "\n".join([text.rstrip("\n"), *response_lines, "", "```", final, "```", "", ""])
    if args.out != "-":
        record(Path(args.out), text, SECTION)
    print(text)
    print(final)
    return final


if __name__ == "__main__":
    main()
