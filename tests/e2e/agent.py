"""An agent loop for end-to-end tests: a long system prompt with tool definitions, then steps of an assistant
tool call (the simulated model's own, through the gateway) and tool results of thousands of tokens, the whole
history sent back every step. Each step is also run on the co-located baseline engine given the very prompt
ids the gateway sent: the same ids must come back (wrong KV gives other tokens)."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any

from tests.e2e.stack import Stack

# The simulated engines for an agent loop: tools on, JSON that sometimes re-renders differently, room for
# ~90k-token histories.
AGENT_SIM = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--tool-call-style", "varied",
             "--tool-call-rate", "0.9", "--max-model-len", "131072", "--num-blocks", "12000"]
WORDS = ("alpha bravo charlie delta echo foxtrot river stone cloud light garden window market signal forest "
         "ocean valley summer winter number paper simple yellow bridge castle dragon island planet rocket").split()
UNICODE = ("Zürich", "東京", "naïve café", "Ελλάδα", "🙂", "São Paulo", "Łódź", "—", "ñ")


def _prose(rng: random.Random, words: int) -> str:
    out = []
    for i in range(words):
        out.append(rng.choice(UNICODE) if rng.random() < 0.03 else rng.choice(WORDS))
        if i % 17 == 16:
            out.append(f"{rng.randint(0, 99999)}.\n")
    return " ".join(out)


def tools(count: int = 16) -> list[dict[str, Any]]:
    rng = random.Random(7)
    return [{"type": "function", "function": {
        "name": f"tool_{i}_{rng.choice(WORDS)}", "description": _prose(rng, 45),
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string", "description": _prose(rng, 12)},
            "limit": {"type": "integer"}, "mode": {"enum": ["fast", "exact", "größer"]},
            "tags": {"type": "array", "items": {"type": "string"}}}, "required": ["query"]}}}
        for i in range(count)]


def system_prompt(words: int = 1100) -> str:
    return "You are a careful agent. Rules follow.\n" + _prose(random.Random(11), words)


def tool_result(rng: random.Random, call: dict[str, Any], share: float = 1.0) -> str:
    """About 1-4k tokens (times `share`): JSON with prose, numbers and non-ASCII text, as a search returns."""
    body = {"tool": call["function"]["name"], "ok": True, "items": [
        {"id": i, "text": _prose(rng, 60), "score": round(rng.random(), 4)}
        for i in range(max(1, round(rng.randint(5, 17) * share)))]}
    return json.dumps(body, ensure_ascii=rng.random() < 0.3, indent=rng.choice([None, 2]))


@dataclass
class Step:
    plan: str
    reason: str
    reused: int
    prompt_tokens: int
    completion_tokens: int
    computed: int            # prompt tokens P computed (sim oracle)
    called: bool
    exact: bool              # the baseline engine given the same prompt ids generated the same ids


@dataclass
class AgentLoop:
    stack: Stack
    session: str
    stream: bool | None = False          # None: alternate JSON and streamed steps
    tools: list[dict[str, Any]] = field(default_factory=tools)
    messages: list[dict[str, Any]] = field(default_factory=list)
    steps: list[Step] = field(default_factory=list)
    seed: int = 0

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.messages = [{"role": "system", "content": system_prompt()},
                         {"role": "user", "content": "Find out what changed in the river stone market."}]

    def run(self, steps: int) -> list[Step]:
        for _ in range(steps):
            self.step()
        return self.steps

    def step(self) -> Step:
        stream = len(self.steps) % 2 == 1 if self.stream is None else self.stream
        prefill = self.stack.prefill[0]
        before = self.stack.stats(prefill)["prompt_tokens_computed"]
        raw = self.stack.client().chat.completions.with_raw_response.create(
            model="demo", messages=self.messages, tools=self.tools, stream=stream, max_tokens=400,
            extra_headers={"X-Session-Id": self.session}, extra_body={"return_token_ids": True},
            **({"stream_options": {"include_usage": True}} if stream else {}))
        content, calls, prompt_ids, output_ids, usage = (_streamed if stream else _whole)(raw.parse())
        step = Step(raw.headers["x-pd-plan"], raw.headers["x-pd-reason"], int(raw.headers["x-pd-reused-tokens"]),
                    usage["prompt_tokens"], usage["completion_tokens"],
                    self.stack.stats(prefill)["prompt_tokens_computed"] - before, bool(calls),
                    self._baseline(prompt_ids) == output_ids)
        self.steps.append(step)
        self._answer(content, calls)
        return step

    def _baseline(self, prompt_ids: list[int]) -> list[int]:
        out = self.stack.baseline_client().chat.completions.create(
            model="demo", messages=self.messages, tools=self.tools, max_tokens=400,
            extra_body={"return_token_ids": True, "kv_transfer_params": {"prompt_token_ids": prompt_ids}})
        return out.choices[0].model_extra["token_ids"]

    def _answer(self, content: str | None, calls: list[dict[str, Any]]) -> None:
        """The client's side of the loop: the assistant message as received, then each call's result."""
        if not calls:
            self.messages += [{"role": "assistant", "content": content},
                              {"role": "user", "content": "Go on with the next step."}]
            return
        self.messages.append({"role": "assistant", "content": content, "tool_calls": calls})
        for call in calls:          # parallel calls share one step's 1-4k tokens of results
            result = tool_result(self.rng, call, 1 / len(calls))
            self.messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})


def _whole(out: Any) -> tuple[str | None, list[dict[str, Any]], list[int], list[int], dict[str, int]]:
    data = out.model_dump()
    message = data["choices"][0]["message"]
    calls = [{"id": c["id"], "type": "function", "function": c["function"]} for c in message["tool_calls"] or ()]
    return message["content"], calls, data["prompt_token_ids"], data["choices"][0]["token_ids"], data["usage"]


def _streamed(chunks: Any) -> tuple[str | None, list[dict[str, Any]], list[int], list[int], dict[str, int]]:
    content, calls, prompt_ids, output_ids, usage = "", [], [], [], {}
    for chunk in chunks:
        data = chunk.model_dump()
        prompt_ids = data.get("prompt_token_ids") or prompt_ids
        usage = data.get("usage") or usage
        for choice in data["choices"]:
            output_ids += choice.get("token_ids") or []
            delta = choice["delta"]
            content += delta.get("content") or ""
            add_tool_deltas(calls, delta.get("tool_calls"))
    return content or None, calls, prompt_ids, output_ids, usage


def add_tool_deltas(calls: list[dict[str, Any]], deltas: Any) -> None:
    """A streamed chunk's tool-call deltas onto the calls so far: a new index brings id and name, every delta
    a fragment of the arguments (as vLLM streams them)."""
    for tc in deltas or ():
        if tc["index"] == len(calls):
            calls.append({"id": tc["id"], "type": "function",
                          "function": {"name": tc["function"]["name"], "arguments": ""}})
        calls[tc["index"]]["function"]["arguments"] += (tc.get("function") or {}).get("arguments") or ""
