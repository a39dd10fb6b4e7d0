"""One `pd-gateway verify` run: the suite through the gateway and to the baseline, the controls at each P-D
pair, then the clean-up (the run's conversations deleted through the admin API, which releases the D blocks
their handles pin; the controls spend or release their own), then the verdicts."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import aiohttp

from gateway.config import DEFAULT_TENANT
from gateway.engines.capacity import kv_capacity
from gateway.verify import judge, suite
from gateway.verify.controls import KINDS, Controls, Target
from gateway.verify.http import Answer, Wire

DEFAULT_TIMEOUT_S = 120.0
VOCABULARY_WORDS = 400


@dataclass(frozen=True)
class Options:
    gateway: str
    prefill: list[str]
    decode: list[str]
    baseline: str
    model: str | None = None
    api_key: str | None = None          # the gateway's client key, when it asks for one
    admin_key: str | None = None        # to delete the run's conversations (their D handles) afterwards
    tenant: str = DEFAULT_TENANT        # the tenant `api_key` belongs to
    quick: bool = False
    timeout_s: float = DEFAULT_TIMEOUT_S


@dataclass
class Result:
    verdicts: list[judge.Verdict]
    noise_floor: float
    model: str
    conversations: int = 0              # the run's conversations on the gateway
    deleted: int = 0                    # of them, deleted (their handles released) through the admin API
    released: int = 0                   # control handles released unspent
    reuse: dict[str, int] = field(default_factory=dict)   # X-PD-Plan of the later turns, counted
    problems: list[str] = field(default_factory=list)     # what went wrong around the judging (fails the run)
    warnings: list[str] = field(default_factory=list)     # what the run could not do (does not fail it)

    @property
    def failures(self) -> list[judge.Verdict]:
        return [v for v in self.verdicts if not v.as_expected]

    @property
    def left_pinned(self) -> int:
        return self.conversations - self.deleted

    @property
    def passed(self) -> bool:
        judged = [v for v in self.verdicts if v.status != "skipped" and not v.expect_wrong]
        controls = [v for v in self.verdicts if v.expect_wrong]
        return bool(judged) and bool(controls) and not self.failures and not self.problems


async def verify(options: Options) -> Result:
    async with aiohttp.ClientSession() as session:
        return await _Run(Wire(session, options.timeout_s), options).all()


class _Run:
    def __init__(self, wire: Wire, options: Options) -> None:
        self.wire, self.o = wire, options
        self.nonce = uuid.uuid4().hex[:12]
        self.sessions: list[str] = []
        self.conversations: dict[str, str] = {}     # session id -> the gateway's id for it (X-PD-Session)
        self.reuse: dict[str, int] = {}
        self.problems: list[str] = []
        self.warnings: list[str] = []

    async def all(self) -> Result:
        model = self.o.model or await self._model()
        max_len = await self._max_model_len(model)
        observations: list[judge.Observation] = []
        for case in suite.build(self.nonce, quick=self.o.quick, long_words=min(900, max_len // 4)):
            observations += await self._case(case, model)
        released = 0
        pairs = [(p, d) for p in self.o.prefill for d in self.o.decode]
        for prefill, decode in pairs[:1] if self.o.quick else pairs:
            controls = Controls(self.wire, await self._target(prefill, decode, model, max_len))
            try:
                for kind in KINDS:
                    observations.append(await controls.run(kind))
            finally:
                released += await controls.release()
        deleted = await self._delete_conversations()
        verdicts, noise = judge.judge_all(observations)
        return Result(verdicts, noise, model, len(self.sessions), deleted, released, self.reuse, self.problems,
                      self.warnings)

    # -- the suite ------------------------------------------------------------------------------------------
    async def _case(self, case: suite.Case, model: str) -> list[judge.Observation]:
        session = f"pdgw-verify-{self.nonce}-{case.name}"
        self.sessions.append(session)
        chat = case.endpoint == "/v1/chat/completions"
        history: list[dict[str, Any]] = []
        out = []
        for i, turn in enumerate(case.turns, 1):
            body: dict[str, Any] = {"model": model, **suite.sampling(case.endpoint, quick=self.o.quick),
                                    **turn.extra, "stream": turn.stream}
            if chat:
                history = turn.step(history)
                body["messages"] = history
            else:
                body["prompt"] = case.prompt
            headers = {"X-Session-Id": session, **self._auth(self.o.api_key)}
            got = await self.wire.post(self.o.gateway, case.endpoint, body, headers)
            if got.headers.get("x-pd-session"):       # the id scoped by the conversation's head
                self.conversations[session] = got.headers["x-pd-session"]
            ref = await self.wire.post(self.o.baseline, case.endpoint, {**body, "stream": False})
            again = await self.wire.post(self.o.baseline, case.endpoint,
                                         {**body, "stream": False, "cache_salt": uuid.uuid4().hex})
            name = case.name if len(case.turns) == 1 else f"{case.name} turn {i}"
            plan = f"{got.headers.get('x-pd-plan', '-')}/{got.headers.get('x-pd-reason', '-')}"
            if i > 1:                  # did the later turns read D's KV? (correct either way: reported only)
                kind = got.headers.get("x-pd-plan", "none")
                self.reuse[kind] = self.reuse.get(kind, 0) + 1
            observation = judge.Observation(name, _output(got, chat), _output(ref, chat), _output(again, chat),
                                            note=plan)
            out.append(observation)
            if not observation.got.ok:
                break                  # no answer to build the next turn's history on
            if chat:
                history = [*history, _assistant(observation.got)]
        return out

    # -- what the run needs to know first -------------------------------------------------------------------
    async def _model(self) -> str:
        answer = await self.wire.get(self.o.gateway, "/v1/models", self._auth(self.o.api_key))
        data = answer.body.get("data") if isinstance(answer.body, dict) else None
        if answer.status != 200 or not data:
            raise VerifyError(f"the gateway's /v1/models answered {answer.status}: {str(answer.body)[:200]} "
                              "(pass --model, and --api-key if it needs one)")
        return str(data[0]["id"])

    async def _max_model_len(self, model: str) -> int:
        answer = await self.wire.get(self.o.baseline, "/v1/models")
        cards = answer.body.get("data") if isinstance(answer.body, dict) else None
        if answer.status != 200 or not cards:
            raise VerifyError(f"the baseline's /v1/models answered {answer.status}: is {self.o.baseline} an engine?")
        lengths = [c.get("max_model_len") for c in cards if c.get("id") == model] or \
            [c.get("max_model_len") for c in cards]
        return next((n for n in lengths if isinstance(n, int) and n > 0), 4096)

    async def _target(self, prefill: str, decode: str, model: str, max_len: int) -> Target:
        text = " ".join(suite.Text(suite.SEED + 1).words(VOCABULARY_WORDS).split())
        tokenized = await self.wire.post(self.o.baseline, "/tokenize", {"model": model, "prompt": text})
        tokens = tokenized.body.get("tokens") if isinstance(tokenized.body, dict) else None
        if not tokens:
            raise VerifyError(f"the baseline's /tokenize answered {tokenized.status}: {str(tokenized.body)[:200]}")
        metrics = await self.wire.get(prefill, "/metrics")
        block = kv_capacity(metrics.body if isinstance(metrics.body, str) else "").block_size or 16
        # several whole blocks, more than kv_recompute_threshold, and room for the longest control prompt
        history = min(max(4 * block, 256) if not self.o.quick else max(2 * block, 160), max_len // 3)
        return Target(prefill, decode, self.o.baseline, model, sorted(set(tokens)), history)

    # -- clean-up ---------------------------------------------------------------------------------------------
    async def _delete_conversations(self) -> int:
        """Each conversation's stored D handle, released through the admin API (it frees D's blocks)."""
        if not self.o.admin_key:
            self.warnings.append(f"no --admin-key: the run's {len(self.sessions)} conversations keep their D "
                                 "handles pinned until the gateway drops them (decoder_kv_blocks_ttl)")
            return 0
        deleted = 0
        for session in self.sessions:
            stored = quote(self.conversations.get(session, session), safe="")
            answer = await self.wire.delete(self.o.gateway, f"/admin/conversations/{stored}?tenant={self.o.tenant}",
                                            self._auth(self.o.admin_key))
            if answer.status in (200, 404):       # 404: the gateway stored nothing for it (a failed first turn)
                deleted += 1
            else:
                self.problems.append(f"deleting conversation {session} answered {answer.status}")
        return deleted

    @staticmethod
    def _auth(key: str | None) -> dict[str, str]:
        return {"Authorization": f"Bearer {key}"} if key else {}


class VerifyError(Exception):
    """The run cannot start: an address does not answer as the kind of server it should be."""


def _output(answer: Answer, chat: bool) -> judge.Output:
    if answer.status == 0:
        return judge.Output(0, error=answer.error)
    if answer.chunks is not None:
        return judge.from_chunks(answer.status, answer.chunks, chat)
    return judge.from_json(answer.status, answer.body, chat)


def _assistant(output: judge.Output) -> dict[str, Any]:
    """The answer as a client puts it back into the history."""
    return {"role": "assistant", "content": output.text}
