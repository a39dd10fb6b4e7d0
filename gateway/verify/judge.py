"""One verdict per request: did the gateway's answer match the baseline's, by the strongest test the engines allow?

Each request goes once through the gateway (or, for a control, straight to P) and twice to the baseline: as is
(its prefix cache may hold the prompt) and with a fresh `cache_salt` (it must compute everything). The two
baseline answers say what the engines allow:
- equal tokens: the engine is deterministic for this prompt, so the gateway's tokens must equal them (greedy
  equality: any difference is a finding);
- different tokens: rounding moves the engine's own answers (a bf16 GPU, batch shapes), so the first generated
  token's top-k log-probs are compared instead (`distance.py`), against the largest distance the baseline shows
  against itself over the whole run (the noise floor).
Pure: the run (`run.py`) collects `Observation`s, `judge_all` decides once the noise floor is known.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from gateway.verify import distance as lp

Status = Literal["pass", "flagged", "skipped"]


@dataclass(frozen=True)
class Output:
    """What one answer says, streamed or not, in one form."""
    status: int
    text: str = ""
    token_ids: tuple[int, ...] | None = None
    tool_calls: str = ""                                 # names and arguments, as JSON
    first_top: dict[int, float] | None = None            # the first generated token's top-k, by token id
    logprobs: bool = False                               # the answer carried logprobs at all
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status == 200

    def same_answer(self, other: Output) -> bool:
        if self.token_ids is not None and other.token_ids is not None:
            return self.token_ids == other.token_ids
        return (self.text, self.tool_calls) == (other.text, other.tool_calls)


@dataclass(frozen=True)
class Observation:
    name: str                     # case/turn, or control
    got: Output                   # through the gateway (a control: straight from P)
    ref: Output                   # the baseline, as is
    again: Output                 # the baseline, prefix cache bypassed
    expect_wrong: bool = False    # a negative control: must be flagged
    note: str = ""                # plan/reason headers, what the control did

    @property
    def deterministic(self) -> bool:
        return self.ref.ok and self.again.ok and self.ref.same_answer(self.again)

    @property
    def floor(self) -> float | None:
        """The baseline against itself: its own noise on this prompt."""
        if self.ref.first_top and self.again.first_top:
            return lp.distance(self.ref.first_top, self.again.first_top).max_abs
        return None

    @property
    def distance(self) -> lp.Distance | None:
        if self.ref.first_top and self.got.first_top:
            return lp.distance(self.ref.first_top, self.got.first_top)
        return None


@dataclass(frozen=True)
class Verdict:
    name: str
    status: Status
    how: str                      # exact | distance | status | logprobs | baseline
    detail: str
    max_abs: float | None = None
    expect_wrong: bool = False
    note: str = ""

    @property
    def as_expected(self) -> bool:
        """A case passes (or is skipped: the baseline refused it too); a negative control is flagged by the
        measure itself: a control that got no answer, or could not be judged, shows nothing."""
        if self.expect_wrong:
            return self.status == "flagged" and self.how in ("exact", "distance")
        return self.status != "flagged"

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status, "how": self.how, "detail": self.detail,
                "max_abs": None if self.max_abs is None else round(self.max_abs, 6),
                "expect_wrong": self.expect_wrong, "as_expected": self.as_expected, "note": self.note}


def noise_floor(observations: Iterable[Observation]) -> float:
    """The largest distance the baseline showed against itself (0 for a deterministic engine)."""
    return max((f for o in observations if (f := o.floor) is not None), default=0.0)


def judge_all(observations: list[Observation]) -> tuple[list[Verdict], float]:
    noise = noise_floor(observations)
    return [judge(o, noise) for o in observations], noise


def judge(o: Observation, noise: float) -> Verdict:
    def verdict(status: Status, how: str, detail: str, max_abs: float | None = None) -> Verdict:
        return Verdict(o.name, status, how, detail, max_abs, o.expect_wrong, o.note)

    if not o.ref.ok:
        return verdict("skipped", "baseline", f"the baseline refused it ({o.ref.status}: {o.ref.error[:120]})")
    if not o.got.ok:
        return verdict("flagged", "status", f"answered {o.got.status} where the baseline answered 200: "
                                            f"{o.got.error[:160]}")
    if o.ref.logprobs and not o.got.logprobs:
        return verdict("flagged", "logprobs", "the answer lost its logprobs (the baseline's has them)")
    d = o.distance
    max_abs = d.max_abs if d is not None else None
    far = d is not None and lp.flagged(d, noise)
    if o.deterministic:
        if not o.got.same_answer(o.ref):
            return verdict("flagged", "exact", _difference(o.got, o.ref), max_abs)
        if far:        # equal tokens, yet another distribution: wrong KV that happened to pick the same tokens
            return verdict("flagged", "distance", f"same tokens, first-token distance {max_abs:.4f} with the "
                                                  "engine deterministic", max_abs)
        return verdict("pass", "exact", "greedy tokens equal the baseline's", max_abs)
    if d is None:
        return verdict("skipped", "distance", "the engine is not deterministic here and no logprobs came back")
    if far:
        return verdict("flagged", "distance", f"first-token distance {max_abs:.4f} above "
                                              f"max(0.05, 4 x noise floor {noise:.4f})", max_abs)
    return verdict("pass", "distance", f"first-token distance {max_abs:.4f} within the noise floor", max_abs)


def _difference(got: Output, ref: Output) -> str:
    if got.token_ids is not None and ref.token_ids is not None:
        at = next((i for i, (a, b) in enumerate(zip(got.token_ids, ref.token_ids)) if a != b),
                  min(len(got.token_ids), len(ref.token_ids)))
        return f"greedy tokens differ from the baseline's at token {at} of {len(ref.token_ids)}"
    return "the answer differs from the baseline's"


# -- answers in one form --------------------------------------------------------------------------------------
def from_json(status: int, body: Any, chat: bool) -> Output:
    """A non-streamed answer (or an error body)."""
    if status != 200 or not isinstance(body, dict) or not body.get("choices"):
        return Output(status if status != 200 else 502, error=_error_text(body))
    choice = body["choices"][0]
    message = choice.get("message") or {}
    text = (message.get("content") or "") if chat else (choice.get("text") or "")
    ids = choice.get("token_ids")
    return Output(200, text, tuple(ids) if isinstance(ids, list) else None, _calls(message.get("tool_calls")),
                  _first_top(choice.get("logprobs"), chat), choice.get("logprobs") is not None)


def from_chunks(status: int, chunks: list[Any], chat: bool, error: str = "") -> Output:
    """A streamed answer: its chunks' text, token ids, tool calls and first logprobs put together."""
    if status != 200:
        return Output(status, error=error)
    text, ids, calls, first, has_logprobs = [], [], {}, None, False
    for chunk in chunks:
        if isinstance(chunk, dict) and "error" in chunk:
            return Output(502, error=_error_text(chunk))
        for choice in (chunk.get("choices") or []) if isinstance(chunk, dict) else []:
            delta = choice.get("delta") or {}
            text.append((delta.get("content") or "") if chat else (choice.get("text") or ""))
            ids += choice.get("token_ids") or delta.get("token_ids") or []
            for call in delta.get("tool_calls") or []:
                slot = calls.setdefault(call.get("index", 0), {"name": "", "arguments": ""})
                fn = call.get("function") or {}
                slot["name"] += fn.get("name") or ""
                slot["arguments"] += fn.get("arguments") or ""
            if choice.get("logprobs") is not None:
                has_logprobs = True
                first = first or _first_top(choice["logprobs"], chat)
    tool_calls = _calls([{"function": calls[i]} for i in sorted(calls)])
    return Output(200, "".join(text), tuple(ids) if ids else None, tool_calls, first, has_logprobs)


def _first_top(logprobs: Any, chat: bool) -> dict[int, float] | None:
    try:
        if chat:
            return lp.from_chat({"choices": [{"logprobs": logprobs}]}) or None
        return lp.from_completion({"choices": [{"logprobs": logprobs}]}) or None
    except (KeyError, IndexError, TypeError, ValueError):
        return None


def _calls(calls: Any) -> str:
    if not calls:
        return ""
    out = []
    for call in calls:
        fn = call.get("function") or {}
        try:
            arguments = json.loads(fn.get("arguments") or "null")
        except ValueError:
            arguments = fn.get("arguments")
        out.append({"name": fn.get("name"), "arguments": arguments})
    return json.dumps(out, sort_keys=True)


def _error_text(body: Any) -> str:
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return str(body["error"].get("message", ""))
    return str(body)[:300]
