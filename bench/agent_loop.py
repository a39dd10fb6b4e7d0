"""Agent loops under the GPU-like cost model: TTFT per step, P's computed prompt tokens against the ideal, with
the gateway keeping D's KV (`--history-tokens generated` and `rendered`), as stateless PD (no session: the
engines' prefix caches only), and through the Responses API (`/v1/responses` with `previous_response_id`: each
step sends only its tool results). The gateway's intake time per step (`pdgw_turn_seconds{phase="intake"}`,
all agents at one step at a time) shows what each step costs before the legs: the chat arm's grows with the
history it re-reads, the Responses arm's does not.

    python bench/agent_loop.py --quick     # 2 agents x 12 steps; writes its section into bench/RESULTS.md
    python bench/agent_loop.py             # 4 agents x 30 steps

Each agent: an ~8k-token system prompt with 16 tool definitions, then steps of the simulated model's tool
call(s) (hermes-style, some JSON that re-renders differently) and 1-4k tokens of tool results, the whole
history sent every step, streamed. Ideal = each step computes only what is not a common prefix of its prompt
and the previous step's held tokens (prompt + output). The last line is
    agent_loop: ttft_later_ms_generated=X rendered=Y stateless=Z computed_over_ideal_generated=A rendered=B
        responses_computed_over_ideal=C intake_last_over_second_chat=D responses=E
(`intake_last_over_second`: mean intake of the last 5 steps over that of steps 2-6.)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import asyncio  # noqa: E402
import gc  # noqa: E402

import msgspec  # noqa: E402

from bench.compare import _common_prefix, _delta, _phase_means, p_stats, reset  # noqa: E402
from gateway.api import responses as responses_api  # noqa: E402
from gateway.api.schemas import ChatRequest, parse  # noqa: E402
from gateway.store import MemoryConversationStore  # noqa: E402
from gateway.telemetry import Metrics  # noqa: E402
from gateway.turns.intake.continued import Continuation  # noqa: E402
from gateway.turns.intake.generated import remember  # noqa: E402
from gateway.turns.intake.intake import Intake  # noqa: E402
from gateway.turns.intake.message_cache import MessageCache  # noqa: E402
from gateway.turns.intake.render import Renderer  # noqa: E402
from gateway.turns.legs.capture import DecodeCapture  # noqa: E402
from gateway.turns.state.stored_responses import StoredResponses  # noqa: E402
from bench.servers import Servers, metrics  # noqa: E402
from tests.e2e.agent import AGENT_SIM, add_tool_deltas, system_prompt, tool_result, tools  # noqa: E402

GPU = ["--prefill-ms-per-token", "0.1", "--decode-ms-per-token", "2", "--transfer-ms-per-block", "0.05",
       "--stream-kv-params", "--num-blocks", "60000"]
SECTION = "## 6. Agent loops, GPU-like cost model (`bench/agent_loop.py`)"


@dataclass
class StepResult:
    ttft_s: float
    prompt_ids: list[int]
    output_ids: list[int]
    plan: str
    new_tokens: int = -1              # Responses arm: the step's prompt tokens beyond what D held (from usage)
    prompt_tokens: int = 0            # Responses arm: its prompt's length (from usage)


@dataclass
class Agent:
    url: str
    index: int
    session: str | None
    tool_defs: list[dict] = field(default_factory=tools)

    def run(self, steps: int) -> list[StepResult]:
        rng = random.Random(self.index)
        messages = [{"role": "system", "content": f"agent {self.index}. " + system_prompt()},
                    {"role": "user", "content": f"Task {self.index}: audit the river stone market."}]
        out = []
        headers = {"X-Session-Id": self.session} if self.session else {}
        with httpx.Client(timeout=300) as http:
            for _ in range(steps):
                step, content, calls = self._step(http, headers, messages)
                out.append(step)
                messages.append({"role": "assistant", "content": content or None,
                                 **({"tool_calls": calls} if calls else {})})
                if not calls:
                    messages.append({"role": "user", "content": "Go on."})
                for call in calls:
                    messages.append({"role": "tool", "tool_call_id": call["id"],
                                     "content": tool_result(rng, call, 1 / len(calls))})
        return out

    def _step(self, http: httpx.Client, headers: dict, messages: list[dict]) -> tuple[StepResult, str, list]:
        body = {"model": "demo", "messages": messages, "tools": self.tool_defs, "stream": True, "max_tokens": 400,
                "return_token_ids": True}
        began, ttft = time.perf_counter(), None
        content, calls, prompt_ids, output_ids = "", [], [], []
        with http.stream("POST", self.url + "/v1/chat/completions", json=body, headers=headers) as resp:
            resp.raise_for_status()
            plan = resp.headers.get("x-pd-plan", "")
            for line in resp.iter_lines():
                if not line.startswith("data:"):
                    continue
                ttft = ttft if ttft is not None else time.perf_counter() - began
                if line[5:].strip() == "[DONE]":
                    continue
                event = json.loads(line[5:])
                prompt_ids = event.get("prompt_token_ids") or prompt_ids
                for choice in event.get("choices") or ():
                    output_ids += choice.get("token_ids") or []
                    delta = choice.get("delta") or {}
                    content += delta.get("content") or ""
                    add_tool_deltas(calls, delta.get("tool_calls"))
        return StepResult(ttft or 0.0, prompt_ids, output_ids, plan), content, calls


@dataclass
class ResponsesAgent:
    """The same agent through `/v1/responses`: the system prompt as instructions, Responses function tools,
    each later step only its tool results (or "Go on.") with `previous_response_id`, streamed."""
    url: str
    index: int
    tool_defs: list[dict] = field(default_factory=lambda: [{"type": "function", **t["function"]} for t in tools()])

    def run(self, steps: int) -> list[StepResult]:
        rng = random.Random(self.index)
        instructions = f"agent {self.index}. " + system_prompt()
        new: object = f"Task {self.index}: audit the river stone market."
        previous, held, out = None, 0, []
        with httpx.Client(timeout=300) as http:
            for _ in range(steps):
                body = {"model": "demo", "instructions": instructions, "input": new, "tools": self.tool_defs,
                        "stream": True, "max_output_tokens": 400, "previous_response_id": previous}
                ttft, plan, final = self._step(http, body)
                usage = final["usage"]
                out.append(StepResult(ttft, [], [], plan, usage["input_tokens"] - held, usage["input_tokens"]))
                held = usage["input_tokens"] + usage["output_tokens"] - 1
                calls = [item for item in final["output"] if item["type"] == "function_call"]
                new = [{"type": "function_call_output", "call_id": c["call_id"],
                        "output": tool_result(rng, {"function": {"name": c["name"]}}, 1 / len(calls))}
                       for c in calls] or "Go on."
                previous = final["id"]
        return out

    def _step(self, http: httpx.Client, body: dict) -> tuple[float, str, dict]:
        began, ttft, final = time.perf_counter(), None, None
        with http.stream("POST", self.url + "/v1/responses", json=body) as resp:
            resp.raise_for_status()
            plan = resp.headers.get("x-pd-plan", "")
            for line in resp.iter_lines():
                if not line.startswith("data:"):
                    continue
                event = json.loads(line[5:])
                if ttft is None and event["type"] == "response.output_item.added":
                    ttft = time.perf_counter() - began           # the answer's first item, as D's first token
                if event["type"] in ("response.completed", "response.incomplete"):
                    final = event["response"]
        assert final is not None, "no response.completed"
        return ttft or 0.0, plan, final


def run_arm(url: str, engines: list, prefills: int, agents: int, steps: int, sessions: bool,
            responses: bool = False) -> dict:
    reset(*engines)
    before = metrics(url)
    run = uuid.uuid4().hex[:8]
    make = (lambda i: ResponsesAgent(url, i)) if responses else \
        (lambda i: Agent(url, i, f"{run}-a{i}" if sessions else None))
    with ThreadPoolExecutor(agents) as pool:
        results = list(pool.map(lambda i: make(i).run(steps), range(agents)))
    stats = p_stats(engines[:prefills])
    first = sum(len(r[0].prompt_ids) or r[0].new_tokens for r in results)
    ideal = sum(_new(r, i) for r in results for i in range(1, len(r)))
    by_step = [statistics.fmean(r[i].ttft_s for r in results) * 1e3 for i in range(steps)]
    return {"ttft_by_step_ms": by_step, "ttft_later_ms": statistics.fmean(by_step[1:]),
            "computed_later": stats["prompt_tokens_computed"] - first, "ideal_later": ideal,
            "last_prompt": statistics.fmean(len(r[-1].prompt_ids) or r[-1].prompt_tokens for r in results),
            "loaded": stats["prompt_tokens_loaded"], "cached": stats["prompt_tokens_cached"],
            "corrupt": stats["kv_reads_corrupt"], "phases": _phase_means(_delta(before, metrics(url))),
            "plans": sorted({s.plan for r in results for s in r[1:]})}


INTAKE_ROUNDS = 3


def intake_by_step(steps: int) -> dict[str, list[float]]:
    """CPU ms per step of intake, chat arm vs Responses arm, median of INTAKE_ROUNDS runs (see intake_run)."""
    runs = [intake_run(steps, seed) for seed in range(INTAKE_ROUNDS)]
    return {arm: [statistics.median(r[arm][i] for r in runs) for i in range(steps)] for arm in ("chat", "responses")}


def intake_run(steps: int, seed: int) -> dict[str, list[float]]:
    """One agent in process: per step, the chat request (the whole history) through parse + Intake.chat + the
    history as D's ids, and the Responses request (the new items) through parse + load + Continuation.turn. D's
    answer is a tool call (hermes, as the simulator writes it); the tool results are the agent's."""
    renderer = Renderer("builtin:demo")
    intake = Intake(renderer, ["demo"], max_model_len=1 << 20)
    continuation, cache = Continuation(intake), MessageCache()
    stored, loop = StoredResponses(MemoryConversationStore(), Metrics()), asyncio.new_event_loop()
    rng, tok, clock = random.Random(seed), renderer.tokenizer, time.process_time
    system, chat_tools = f"agent {seed}. " + system_prompt(), tools()
    functions = [{"type": "function", **t["function"]} for t in chat_tools]
    task = f"Task {seed}: audit the river stone market."
    messages = [{"role": "system", "content": system}, {"role": "user", "content": task}]
    new: object = task
    answers, previous, out = [], None, {"chat": [], "responses": []}
    gc.collect()
    for step in range(steps):
        name = chat_tools[step % len(chat_tools)]["function"]["name"]
        call = {"id": f"call_{seed}_{step}", "type": "function",
                "function": {"name": name, "arguments": json.dumps({"query": f"q {step}"})}}
        generated = f'<tool_call>\n{{"name": "{name}", "arguments": {{"query": "q {step}"}}}}\n</tool_call>'
        output = [*tok.encode(generated, add_special_tokens=False), tok.eos_token_id]
        raw = msgspec.json.encode({"model": "demo", "messages": messages, "tools": chat_tools, "stream": True,
                                   "max_tokens": 400})
        t0 = clock()
        body, req = parse(raw, ChatRequest, cache=cache)
        turn = intake.chat(body, req, "bench")
        if answers:
            turn.prompt_ids = turn.rerender(answers)
        out["chat"].append((clock() - t0) * 1e3)
        answer = renderer.answer(output, "", [call])
        answers = remember(answers, answer) if answer else answers
        raw = msgspec.json.encode({"model": "demo", "instructions": system, "input": new, "tools": functions,
                                   "stream": True, "max_output_tokens": 400, "previous_response_id": previous})
        t0 = clock()
        rreq = responses_api.parse_request(raw)
        rbody, rparsed = parse(msgspec.json.encode(responses_api.chat_body(rreq, "demo")), ChatRequest, cache=cache)
        prev = loop.run_until_complete(stored.load("bench", previous)) if previous else None
        rturn, thread = continuation.turn(prev, system, rbody, rparsed, "bench")
        out["responses"].append((clock() - t0) * 1e3)
        capture = DecodeCapture(prompt_ids=rturn.prompt_ids, output_ids=output, output_ids_seen=True,
                                finish_reason="tool_calls", tool_calls=[{"id": call["id"], "function": call["function"]}])
        previous = responses_api.new_id("resp")
        loop.run_until_complete(stored.save("bench", previous, "chain", rturn, thread, capture, b"{}"))
        result = tool_result(rng, call)
        messages += [{"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": call["id"], "content": result}]
        new = [{"type": "function_call_output", "call_id": call["id"], "output": result}]
    loop.close()
    return out


def _growth(per_step: list[float]) -> float:
    """Mean of the last 5 steps over steps 2-6 (step 1 renders the whole first prompt in every arm)."""
    later, early = per_step[-5:], per_step[1:6]
    return statistics.fmean(later) / max(1e-9, statistics.fmean(early)) if early else 0.0


def _new(steps: list[StepResult], i: int) -> int:
    if steps[i].new_tokens >= 0:
        return steps[i].new_tokens
    held = steps[i - 1].prompt_ids + steps[i - 1].output_ids
    common = min(_common_prefix(steps[i].prompt_ids, held[:len(held) - 1]), len(steps[i].prompt_ids) - 1)
    return len(steps[i].prompt_ids) - common


def report(arms: dict[str, dict], agents: int, steps: int, wall_s: float,
           intake: dict[str, list[float]]) -> tuple[str, str]:
    names = list(arms)
    lines = [SECTION, "",
             f"2 P + 1 D. {agents} agents at once, {steps} streamed steps each: an ~8k-token system prompt with 16 tools, then "
             "tool calls (sim `--tool-call-style varied`: some JSON compact, arguments-first or \\u-escaped) and "
             "1-4k tokens of tool results per step. Engines: prefill 0.1 ms/token, decode 2 ms/token, KV transfer "
             f"0.05 ms/block. TTFT = request sent -> first SSE event, mean over agents. Wall time {wall_s:.0f} s; load "
             f"average at the end {' '.join(f'{x:.1f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs (a "
             "shared machine: TTFT moves with it; P's computed tokens do not).",
             "", "| | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    rows = {"TTFT mean, steps >= 2 (ms)": [f"{a['ttft_later_ms']:.0f}" for a in arms.values()],
            "P computed, steps >= 2 (tokens)": [str(a["computed_later"]) for a in arms.values()],
            "ideal (new tokens), steps >= 2": [str(a["ideal_later"]) for a in arms.values()],
            "computed / ideal": [f"{a['computed_later'] / max(1, a['ideal_later']):.3f}" for a in arms.values()],
            "P read from D / own prefix cache (tokens)": [f"{a['loaded']} / {a['cached']}" for a in arms.values()],
            "mean last prompt (tokens)": [f"{a['last_prompt']:.0f}" for a in arms.values()],
            "plans, steps >= 2": [", ".join(a["plans"]) for a in arms.values()],
            "corrupt KV reads": [str(a["corrupt"]) for a in arms.values()],
            "gateway phases, mean ms": [a["phases"] for a in arms.values()]}
    lines += [f"| {k} | " + " | ".join(v) + " |" for k, v in rows.items()]
    marks = sorted({0, 1, 4, 9, 19, steps - 1} & set(range(steps)))
    lines += ["", "TTFT by step (ms, mean over agents):", "", "| step | " + " | ".join(names) + " |",
              "|---" * (len(names) + 1) + "|"]
    lines += [f"| {i + 1} | " + " | ".join(f"{a['ttft_by_step_ms'][i]:.0f}" for a in arms.values()) + " |"
              for i in marks]
    by_step = intake
    lines += ["", f"Intake CPU by step (ms, in process, no engines: the same agent's requests, `parse` + rendering as "
              f"the handler runs them, the Responses arm's previous response loaded from the embedded store; median of "
              f"{INTAKE_ROUNDS} runs; the collector on):", "", "| step | chat (`/v1/chat/completions`, history generated) | "
              "Responses (`previous_response_id`) |", "|---|---|---|"]
    lines += [f"| {i + 1} | {by_step['chat'][i]:.3f} | {by_step['responses'][i]:.3f} |"
              for i in sorted({0, 1, 4, 9, 19, len(by_step['chat']) - 1} & set(range(len(by_step['chat']))))]
    lines += ["", f"Growth, mean of the last 5 steps over steps 2-6: chat {_growth(by_step['chat']):.2f}x, Responses "
              f"{_growth(by_step['responses']):.2f}x.", ""]
    a = list(arms.values())
    final = (f"agent_loop: ttft_later_ms_generated={a[0]['ttft_later_ms']:.0f} rendered={a[1]['ttft_later_ms']:.0f} "
             f"stateless={a[2]['ttft_later_ms']:.0f} computed_over_ideal_generated="
             f"{a[0]['computed_later'] / max(1, a[0]['ideal_later']):.3f} "
             f"rendered={a[1]['computed_later'] / max(1, a[1]['ideal_later']):.3f} "
             f"responses_computed_over_ideal={a[3]['computed_later'] / max(1, a[3]['ideal_later']):.3f} "
             f"intake_last_over_second_chat={_growth(intake['chat']):.2f} responses={_growth(intake['responses']):.2f}")
    lines += ["```", final, "```"]
    return "\n".join(lines) + "\n", final


def record(path: Path, section: str, title: str = SECTION) -> None:
    """Replace the section `title` of RESULTS.md (compare.py rewrites the file: run this after it)."""
    text = path.read_text() if path.exists() else ""
    start = text.find(title)
    if start >= 0:
        end = text.find("\n## ", start + 1)
        text = text[:start] + section + (text[end + 1:] if end >= 0 else "")
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text)


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2 agents x 12 steps")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "RESULTS.md"), help="'-': nowhere")
    args = ap.parse_args(argv)
    agents, steps = (2, 12) if args.quick else (4, 30)
    began = time.perf_counter()
    with Servers() as servers:
        flags = [*AGENT_SIM, *GPU]         # the later --num-blocks wins
        p0, p1, d = servers.sims([("prefill", "ap0", flags), ("prefill", "ap1", flags), ("decode", "ad0", flags)])
        engines = [p0, p1, d]
        generated, rendered = servers.gateways([([p0, p1], [d], ["--history-tokens", "generated"]),
                                                ([p0, p1], [d], ["--history-tokens", "rendered"])])
        arms = {"gateway, history generated": run_arm(generated.url, engines, 2, agents, steps, True),
                "gateway, history rendered": run_arm(rendered.url, engines, 2, agents, steps, True),
                "stateless PD (no session)": run_arm(generated.url, engines, 2, agents, steps, False),
                "Responses API (previous_response_id)": run_arm(generated.url, engines, 2, agents, steps, True,
                                                                responses=True)}
    text, final = report(arms, agents, steps, time.perf_counter() - began, intake_by_step(steps))
    if args.out != "-":
        record(Path(args.out), text)
    print(text)
    print(final)
    return final


if __name__ == "__main__":
    main()
