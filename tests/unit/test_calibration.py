"""The cost plan's calibration probe (turns/legs/calibration.py): the arithmetic of its three times, the requests it
sends (a scripted engine client, real pools), and what it leaves behind when a step fails."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from gateway.config import Settings
from gateway.engines.pool import EnginePool
from gateway.errors import EngineFailedError, EngineTimeoutError
from gateway.telemetry import Metrics
from gateway.turns.legs.calibration import NEW_TOKENS, READ_DEADLINE_FLOOR_S, RateProbe, sample_of
from gateway.turns.legs.calls import EngineCalls
from gateway.turns.reuse.rates import PrefillTiming, ProbeSample, Rates
from gateway.turns.legs.release import HandleReleaser

P, D = "http://p0", "http://d0"


def test_an_untimed_engine_says_nothing():
    assert sample_of(1024, 4096, compute=(0.010, 0.012), read=(0.011, 0.013)) is None


def test_the_rates_are_marginal_between_the_two_sizes():
    # a fixed 70 ms per leg, as on an H200: computing 52k tokens/s, reading 138k tokens/s
    compute = (0.070 + 1024 / 52_000, 0.070 + 4096 / 52_000)
    read = (0.080 + 1024 / 138_000, 0.080 + 4096 / 138_000)
    sample = sample_of(1024, 4096, compute, read)
    assert sample.tokens == 3072
    assert sample.tokens / sample.compute_s == pytest.approx(52_000)
    assert sample.tokens / sample.read_s == pytest.approx(138_000)


def test_a_read_hidden_in_the_noise_is_very_fast_not_unknown():
    sample = sample_of(1024, 4096, compute=(0.030, 0.090), read=(0.031, 0.030))
    assert sample.read_s > 0 and sample.tokens / sample.read_s > 10 * sample.tokens / sample.compute_s


def test_a_calibrated_pair_goes_by_its_probe_until_an_engine_comes_back():
    rates = Rates()
    for _ in range(5):    # full legs at 10k tokens/s
        rates.observe(PrefillTiming(P, "", 1000, 0, 0, 0, 0.1))
    rates.calibrate(P, D, ProbeSample(3000, compute_s=0.075, read_s=0.3))
    costs = rates.costs(P, D)
    assert costs.prefill_tokens_per_s == pytest.approx(40_000)
    assert costs.transfer_tokens_per_s == pytest.approx(10_000)
    assert rates.costs(P, "http://d1").prefill_tokens_per_s == pytest.approx(10_000)   # another D: the legs'
    rates.forget(D)
    assert rates.costs(P, D).prefill_tokens_per_s == pytest.approx(10_000)


def test_learned_rates_are_exported_at_scrape_time():
    metrics, rates = Metrics(), Rates()
    metrics.engine_names.update({P: "prefill-0", D: "decode-0"})       # engines are labelled by name, not URL
    metrics.learned_rates.source = rates.known
    rates.observe(PrefillTiming(P, "", 1000, 0, 0, 0, 0.1))
    rates.calibrate(P, D, ProbeSample(4000, compute_s=0.1, read_s=0.4))
    text = metrics.render().decode()
    assert 'pdgw_learned_rate_tokens_per_second{decode="decode-0",prefill="prefill-0",rate="read"} 10000.0' in text
    assert 'pdgw_learned_rate_tokens_per_second{decode="decode-0",prefill="prefill-0",rate="prefill"} 40000.0' in text
    assert 'pdgw_learned_rate_tokens_per_second{decode="",prefill="prefill-0",rate="prefill"} 10000.0' in text
    assert "http://" not in text


class Engines:
    """P and D as the probe sees them: P hands out a handle for what it prefilled, D one for what it read."""

    def __init__(self, fail_read: bool = False, d_handle: bool = True, read_timeout: bool = False) -> None:
        self.fail_read, self.d_handle, self.read_timeout = fail_read, d_handle, read_timeout
        self.timeouts: list[float] = []
        self.calls: list[tuple[str, dict[str, Any]]] = []

    async def post_json(self, url: str, path: str, body: dict[str, Any], *, timeout_s: float = 0.0,
                        **_: Any) -> dict[str, Any]:
        self.calls.append((url, body))
        self.timeouts.append(timeout_s)
        params, n = body["kv_transfer_params"], len(body["prompt"])
        if url == D:
            handle = {"remote_engine_id": "d0", "remote_block_ids": [[1]], "remote_num_tokens": n}
            return {"choices": [{}], **({"kv_transfer_params": handle} if self.d_handle else {})}
        if params.get("remote_engine_id") == "d0":
            if params.get("remote_num_tokens") == 0:
                return {"choices": [{}]}                       # a release
            if self.fail_read:
                raise EngineFailedError("prefill failed")
            if self.read_timeout:
                raise EngineTimeoutError("P read D's KV too slowly")
        return {"choices": [{}], "kv_transfer_params": {"remote_engine_id": "p0", "remote_block_ids": [[2]],
                                                        "remote_num_tokens": n}}


def probe_with(engines: Engines, **settings: Any) -> tuple[RateProbe, Rates, HandleReleaser]:
    s = Settings(prefill=[P], decode=[D], **settings)
    metrics, rates = Metrics(), Rates()
    prefill, decode = EnginePool("prefill", s.prefill), EnginePool("decode", s.decode)
    calls = EngineCalls(metrics)
    releaser = HandleReleaser(engines, prefill, calls, metrics, "m")
    probe = RateProbe(client=engines, calls=calls, prefill=prefill, decode=decode, rates=rates, releaser=releaser,
                      vocabulary=list(range(100, 200)), model="m", settings=s)
    return probe, rates, releaser


async def probed(engines: Engines, **settings: Any) -> tuple[RateProbe, Rates, Any]:
    probe, rates, releaser = probe_with(engines, **settings)
    sample = await probe.probe(probe.prefill.engines[P], probe.decode.engines[D])
    await releaser.drain()
    return probe, rates, sample


def test_each_size_prefills_then_d_reads_then_p_reads_d_s_tokens():
    engines = Engines()
    _, rates, sample = asyncio.run(probed(engines, rate_probe_tokens=1024))
    assert sample is None and rates.known() == []       # instant answers: nothing measurable, nothing changed
    assert [url for url, _ in engines.calls] == [P, D, P] * 4          # two sizes, two rounds
    sizes = [len(body["prompt"]) for url, body in engines.calls if url == D]
    assert sizes == [256, 1024, 256, 1024]
    compute, decode, read = engines.calls[3:6]
    assert decode[1]["prompt"] == compute[1]["prompt"]
    assert decode[1]["kv_transfer_params"]["remote_engine_id"] == "p0"
    assert read[1]["prompt"][:1024] == compute[1]["prompt"] and len(read[1]["prompt"]) == 1024 + NEW_TOKENS
    assert read[1]["kv_transfer_params"]["remote_num_tokens"] == 1024
    assert {id for _, body in engines.calls for id in body["prompt"]} <= set(range(100, 200))
    rounds = [body["prompt"] for url, body in engines.calls if url == D]
    assert rounds[1] != rounds[3]                       # fresh ids each round
    salts = [body["cache_salt"] for _, body in engines.calls]
    assert len(set(salts)) == len(salts)                # and a fresh salt each request: P's own cache misses


def test_a_failed_read_releases_d_s_blocks_and_keeps_the_rates():
    engines = Engines(fail_read=True)
    _, rates, sample = asyncio.run(probed(engines, rate_probe_tokens=1024))
    assert sample is None and rates.known() == []
    released = [body for url, body in engines.calls if body["kv_transfer_params"].get("remote_num_tokens") == 0]
    assert len(released) == 1 and released[0]["kv_transfer_params"]["remote_engine_id"] == "d0"


def test_a_read_outlasting_its_deadline_is_evidence_that_reading_does_not_pay():
    engines = Engines(read_timeout=True)
    _, rates, sample = asyncio.run(probed(engines, rate_probe_tokens=1024))
    assert sample is not None and sample.tokens == 256 and sample.read_s == READ_DEADLINE_FLOOR_S
    costs = rates.costs(P, D)
    assert costs.transfer_tokens_per_s < costs.prefill_tokens_per_s      # the pair recomputes from now on
    read_timeouts = [t for (url, body), t in zip(engines.calls, engines.timeouts)
                     if url == P and body["kv_transfer_params"].get("remote_engine_id") == "d0"
                     and body["kv_transfer_params"].get("remote_num_tokens")]
    assert read_timeouts == [READ_DEADLINE_FLOOR_S]       # 4x P's compute time, at least the floor
    released = [body for url, body in engines.calls if body["kv_transfer_params"].get("remote_num_tokens") == 0]
    assert len(released) == 1                             # D's blocks freed all the same


def test_no_handle_from_d_ends_the_probe():
    engines = Engines(d_handle=False)
    _, rates, sample = asyncio.run(probed(engines, rate_probe_tokens=1024))
    assert sample is None and [url for url, _ in engines.calls] == [P, D]


@pytest.mark.parametrize("info, tokens", [
    ({}, 8192),
    ({"num_gpu_blocks": 1000, "block_size": 16}, 2000),       # an eighth of the smaller pool
    ({"max_model_len": 2048}, 2048 - NEW_TOKENS - 1),
])
def test_the_probe_fits_the_engines(info, tokens):
    probe, _, _ = probe_with(Engines())
    vars(probe.decode.engines[D].facts).update(info)
    assert probe._size(probe.prefill.engines[P], probe.decode.engines[D]) == tokens


def test_a_pool_too_small_for_a_measurable_read_is_not_probed():
    engines = Engines()
    probe, _, _ = probe_with(engines)
    vars(probe.decode.engines[D].facts).update(num_gpu_blocks=511, block_size=16)     # 1022 tokens: under 1024
    assert asyncio.run(probe.probe(probe.prefill.engines[P], probe.decode.engines[D])) is None
    assert engines.calls == []


def test_pairs_are_due_once_per_interval_and_again_when_an_engine_comes_back():
    engines = Engines()
    probe, _, _ = probe_with(engines, rate_probe_tokens=1024, rate_probe_interval_s=3600)

    async def passes() -> list[int]:
        counts = []
        for back in (False, False, True):
            if back:
                probe.engine_back(probe.decode.engines[D])
            engines.calls.clear()
            await probe.probe_due()
            counts.append(len(engines.calls))
        return counts
    assert asyncio.run(passes()) == [12, 0, 12]

