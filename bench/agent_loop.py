"""Agent loops under the GPU-like cost model: TTFT per step, P's computed prompt tokens against the ideal, with
the gateway keeping D's KV (`--history-tokens generated` and `rendered`) and as stateless PD (no session: the
engines' prefix caches only).

    python bench/agent_loop.py --quick     # 2 agents x 12 steps; writes its section into bench/RESULTS.md
    python bench/agent_loop.py             # 4 agents x 30 steps

Each agent: an ~8k-token system prompt with 16 tool definitions, then steps of the simulated model's tool
call(s) (hermes-style, some JSON that re-renders differently) and 1-4k tokens of tool results, the whole
history sent every step, streamed. Ideal = each step computes only what is not a common prefix of its prompt
and the previous step's held tokens (prompt + output). The last line is
    agent_loop: ttft_later_ms_generated=X rendered=Y stateless=Z computed_over_ideal_generated=A rendered=B
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

from bench.compare import _common_prefix, _delta, _phase_means, p_stats, reset  # noqa: E402
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


def run_arm(url: str, engines: list, prefills: int, agents: int, steps: int, sessions: bool) -> dict:
    reset(*engines)
    before = metrics(url)
    run = uuid.uuid4().hex[:8]
    with ThreadPoolExecutor(agents) as pool:
        results = list(pool.map(lambda i: Agent(url, i, f"{run}-a{i}" if sessions else None).run(steps),
                                range(agents)))
    stats = p_stats(engines[:prefills])
    first = sum(len(r[0].prompt_ids) for r in results)
    ideal = sum(_new(r, i) for r in results for i in range(1, len(r)))
    by_step = [statistics.fmean(r[i].ttft_s for r in results) * 1e3 for i in range(steps)]
    return {"ttft_by_step_ms": by_step, "ttft_later_ms": statistics.fmean(by_step[1:]),
            "computed_later": stats["prompt_tokens_computed"] - first, "ideal_later": ideal,
            "last_prompt": statistics.fmean(len(r[-1].prompt_ids) for r in results),
            "loaded": stats["prompt_tokens_loaded"], "cached": stats["prompt_tokens_cached"],
            "corrupt": stats["kv_reads_corrupt"], "phases": _phase_means(_delta(before, metrics(url))),
            "plans": sorted({s.plan for r in results for s in r[1:]})}


def _new(steps: list[StepResult], i: int) -> int:
    held = steps[i - 1].prompt_ids + steps[i - 1].output_ids
    common = min(_common_prefix(steps[i].prompt_ids, held[:len(held) - 1]), len(steps[i].prompt_ids) - 1)
    return len(steps[i].prompt_ids) - common


def report(arms: dict[str, dict], agents: int, steps: int, wall_s: float) -> tuple[str, str]:
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
    a = list(arms.values())
    final = (f"agent_loop: ttft_later_ms_generated={a[0]['ttft_later_ms']:.0f} rendered={a[1]['ttft_later_ms']:.0f} "
             f"stateless={a[2]['ttft_later_ms']:.0f} computed_over_ideal_generated="
             f"{a[0]['computed_later'] / max(1, a[0]['ideal_later']):.3f} "
             f"rendered={a[1]['computed_later'] / max(1, a[1]['ideal_later']):.3f}")
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
                "stateless PD (no session)": run_arm(generated.url, engines, 2, agents, steps, False)}
    text, final = report(arms, agents, steps, time.perf_counter() - began)
    if args.out != "-":
        record(Path(args.out), text)
    print(text)
    print(final)
    return final


if __name__ == "__main__":
    main()
