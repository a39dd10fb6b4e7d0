"""Calibration probes for the cost plan (issue 17): measure, per P-D pair, how fast P computes a prompt and how
fast it reads the same tokens from D's KV, with requests of the gateway's own, before any turn has to pay for
learning it; again every `rate_probe_interval_s`, and when an engine comes back (it may be another process, on
another transport). So a pair whose reads are slow recomputes from its first later turn on, and a pair that only
recomputes still notices a transport that got faster.

One round, on /v1/completions with random token ids and a fresh `cache_salt` on every request (no prefix cache
holds them: P must not find the ids it prefilled when it reads them back from D), at two sizes n = N/4 and N:
  compute(n)  P prefills n ids, holding them for D; D reads them from P and decodes one token (D now holds n)
  read(n)     P reads D's n tokens and computes K new ones
The rates are marginal, from the differences between the two sizes: what a P leg costs whatever it does (HTTP,
scheduling, P's forward pass over the new tokens, NIXL's handshake and notification) cancels out. On an H200 in
eager mode that fixed part is 60-90 ms, as large as computing 4k tokens, so a single size would hide the answer
(bench/GPU-RESULTS.md). Each time is the least over the rounds: noise only adds, and the first round pays the P-D
handshake. A probe whose differences stay within the noise (engines without a timing model, such as untimed
simulators) says nothing, and the pair keeps the rates learned from its legs. A read that outlasts its
deadline (`READ_DEADLINE_FACTOR` times what P took to compute the same tokens) is evidence, not silence: the
pair's read rate is below that size over that time, so the pair recomputes from its first later turn on, rather
than reading until a leg teaches it otherwise (issue 24: on a slow transport that cost 1.5x stateless PD). The read legs' P answers are
decoded by nobody: P frees those blocks after vLLM's `kv_lease_duration`, as for any abandoned prefill.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from typing import Any

from gateway.config import Settings
from gateway.engines import kv
from gateway.engines.client import EngineClient
from gateway.engines.engine import Engine
from gateway.engines.pool import EnginePool
from gateway.errors import EngineTimeoutError, GatewayError
from gateway.turns.legs.calls import EngineCalls
from gateway.turns.reuse.rates import MIN_READ_TOKENS, ProbeSample, Rates
from gateway.turns.legs.release import HandleReleaser

log = logging.getLogger(__name__)

ROUNDS = 2
NEW_TOKENS = 16                 # K: what P computes on a read leg
SMALL_SHARE = 4                 # the smaller size is N / 4
MIN_PROBE_TOKENS = 4 * SMALL_SHARE * MIN_READ_TOKENS   # so that even the small read is 4x vLLM's recompute threshold
MIN_SIGNAL_S = 0.003            # below this, a difference is noise, not compute or transfer
SHORTEST_S = 1e-4               # a part hidden in that noise: "very fast", not "unknown"
CAPACITY_SHARE = 8              # a probe takes at most 1/8 of P's or D's KV blocks
PROBE_TIMEOUT_S = 30.0
READ_DEADLINE_FACTOR = 4.0      # a probe read slower than this many times P's compute of it: reading does not pay
READ_DEADLINE_FLOOR_S = 2.0     # ... but never a deadline below this (handshakes, a first connection)
TICK_S = 5.0                    # how often due pairs are looked for
PROBE_TEXT = ("The quick brown fox jumps over the lazy dog while seven wizards quietly judge boxing matches; "
              "pack my box with five dozen liquor jugs, then measure how long the KV cache takes to move.")


def sample_of(small: int, large: int, compute: tuple[float, float], read: tuple[float, float]) -> ProbeSample | None:
    """The marginal rates between the two sizes, from (small, large) times of each kind; None: nothing measurable."""
    computing, reading = compute[1] - compute[0], read[1] - read[0]
    if max(computing, reading) < MIN_SIGNAL_S:
        return None
    return ProbeSample(large - small, max(SHORTEST_S, computing), max(SHORTEST_S, reading))


class RateProbe:
    """Keeps every healthy P-D pair's rates calibrated: `run()` probes each pair when it is due."""

    def __init__(self, *, client: EngineClient, calls: EngineCalls, prefill: EnginePool, decode: EnginePool,
                 rates: Rates, releaser: HandleReleaser, vocabulary: list[int], model: str,
                 settings: Settings) -> None:
        self.client, self.calls, self.rates, self.releaser = client, calls, rates, releaser
        self.prefill, self.decode, self.model = prefill, decode, model
        self.tokens, self.interval_s = settings.rate_probe_tokens, settings.rate_probe_interval_s
        self.vocabulary = sorted(set(vocabulary))
        self.first_pass = asyncio.Event()
        self._probed: dict[tuple[str, str], float] = {}      # pair -> when it was last probed (monotonic)
        self._random = random.Random()

    async def wait_first_pass(self, timeout_s: float) -> None:
        """Start-up waits this long at most for every pair's first probe; probing goes on regardless."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.first_pass.wait(), timeout_s)

    async def run(self) -> None:
        while True:
            await self.probe_due()
            self.first_pass.set()
            await asyncio.sleep(min(TICK_S, self.interval_s))

    def engine_back(self, engine: Engine) -> None:
        """The health checker's hook: an engine back in rotation is probed again on the next tick; until then its
        pairs go by what their legs teach."""
        self.rates.forget(engine.url)
        for pair in [pair for pair in self._probed if engine.url in pair]:
            del self._probed[pair]

    async def probe_due(self) -> None:
        now = time.monotonic()
        for p in self.prefill.healthy():
            for d in self.decode.healthy():
                if now - self._probed.get((p.url, d.url), -self.interval_s) >= self.interval_s:
                    self._probed[(p.url, d.url)] = now
                    await self.probe(p, d)

    async def probe(self, p: Engine, d: Engine) -> ProbeSample | None:
        large = self._size(p, d)
        if large < MIN_PROBE_TOKENS:
            return None
        small = large // SMALL_SHARE
        rounds: list[list[float]] = []
        try:
            for _ in range(ROUNDS):
                rounds.append([t for n in (small, large) for t in await self._legs(p, d, n)])
        except SlowRead as slow:
            sample = ProbeSample(slow.tokens, max(SHORTEST_S, slow.compute_s), slow.deadline_s)   # read: at most
            self.rates.calibrate(p.url, d.url, sample)
            log.info("rate probe %s -> %s: a %d-token read outlasted %.1f s, %s", p.url, d.url, slow.tokens,
                     slow.deadline_s, _described(sample))
            return sample
        except (GatewayError, LookupError) as exc:
            log.info("rate probe %s -> %s failed (%s): rates unchanged", p.url, d.url, exc)
            return None
        c_small, r_small, c_large, r_large = (min(times) for times in zip(*rounds))
        sample = sample_of(small, large, (c_small, c_large), (r_small, r_large))
        if sample is not None:
            self.rates.calibrate(p.url, d.url, sample)
        log.info("rate probe %s -> %s, %d and %d tokens: %s", p.url, d.url, small, large, _described(sample))
        return sample

    def _size(self, p: Engine, d: Engine) -> int:
        """The probe's N: the setting, within a share of either engine's KV and within the model's length."""
        limits = [self.tokens]
        for engine in (p, d):
            blocks, block_size = engine.facts.num_gpu_blocks, engine.facts.block_size
            if blocks and block_size:
                limits.append(blocks * block_size // CAPACITY_SHARE)
            if length := engine.facts.max_model_len:
                limits.append(length - NEW_TOKENS - 1)
        return min(limits) if self.vocabulary else 0

    async def _legs(self, p: Engine, d: Engine, n: int) -> tuple[float, float]:
        """P computing n fresh ids, then (once D holds them) P reading them back from D: both leg times."""
        ids = self._ids(n)
        compute_s, answer = await self._timed(p, ids, kv.fresh_prefill())
        held = await self._read_by_decode(d, ids, kv.peek(answer))
        deadline_s = min(PROBE_TIMEOUT_S, max(READ_DEADLINE_FLOOR_S, READ_DEADLINE_FACTOR * compute_s))
        try:
            read_s, _ = await self._timed(p, ids + self._ids(NEW_TOKENS), kv.leg_params(held), deadline_s)
        except GatewayError as exc:
            self.releaser.release(held, "probe")     # P may not have read it: free D's blocks
            if isinstance(exc, EngineTimeoutError):
                raise SlowRead(n, compute_s, deadline_s) from exc
            raise
        return compute_s, read_s

    async def _read_by_decode(self, d: Engine, ids: list[int], prefill_handle: kv.Handle | None) -> kv.Handle:
        if prefill_handle is None:
            raise LookupError("P returned no handle")
        answer = await self._post(d, ids, kv.decode_params(prefill_handle))
        held = kv.take(answer)
        if held is None or held.num_tokens != len(ids):
            if held is not None:
                self.releaser.release(held, "probe")
            raise LookupError("D returned no handle for the probe's tokens")
        return held

    async def _timed(self, p: Engine, ids: list[int], params: dict[str, Any],
                     timeout_s: float = PROBE_TIMEOUT_S) -> tuple[float, dict[str, Any]]:
        began = time.perf_counter()
        answer = await self._post(p, ids, params, timeout_s)
        return time.perf_counter() - began, answer

    async def _post(self, engine: Engine, ids: list[int], params: dict[str, Any],
                    timeout_s: float = PROBE_TIMEOUT_S) -> dict[str, Any]:
        body = {"model": self.model, "prompt": ids, "max_tokens": 1, "stream": False, kv.WIRE_KEY: params,
                "cache_salt": self._random.randbytes(8).hex()}
        return await self.calls.call(engine, self.client.post_json(
            engine.url, "/v1/completions", body, timeout_s=timeout_s), prompt_tokens=len(ids))

    def _ids(self, n: int) -> list[int]:
        return self._random.choices(self.vocabulary, k=n)


class SlowRead(Exception):
    """A probe read of `tokens` outlasted its deadline: P computed them in `compute_s`."""

    def __init__(self, tokens: int, compute_s: float, deadline_s: float) -> None:
        super().__init__(f"a {tokens}-token read outlasted {deadline_s:.1f} s")
        self.tokens, self.compute_s, self.deadline_s = tokens, compute_s, deadline_s


def _described(sample: ProbeSample | None) -> str:
    if sample is None:
        return "nothing measurable (no timing above the fixed part)"
    compute, read = sample.tokens / sample.compute_s, sample.tokens / sample.read_s
    return (f"prefill {compute:,.0f} tokens/s, read {read:,.0f} tokens/s: "
            f"{'reading' if read > compute else 'recomputing'} pays")
