"""The start-up report's pure parts: parity comparison, findings, verdict, what it says about reuse."""

from __future__ import annotations

import pytest

from gateway import startup, startup_findings
from gateway.config import Settings
from gateway.engines.facts import KvTransfer
from gateway.startup_findings import EngineReport

KV = {"connector": "NixlConnector", "bidirectional": True}


def engine(role="prefill", **kw) -> EngineReport:
    kv_role = {"prefill": "kv_producer", "decode": "kv_consumer"}[role]
    defaults = dict(url=f"http://{role}:1", role=role, reachable=True, version="0.32.0", block_size=16,
                    models=["m"], kv_transfer={**KV, "role": kv_role, "failure_policy": "fail",
                                               "decoder_kv_blocks_ttl": 480.0}, parity="match")
    report = {**defaults, **kw}
    if report["kv_transfer"] is not None:        # written as dicts here: the fields /server_info shows
        report["kv_transfer"] = KvTransfer(**report["kv_transfer"])
    return EngineReport(**report)


@pytest.mark.parametrize(("got", "verdict", "detail"), [
    ([1, 2, 3], "match", "3 tokens"),
    (None, "unknown", "no /tokenize"),
    ([1, 9, 3], "mismatch", "token 1"),
    ([1, 2], "mismatch", "token 2"),
])
def test_compare(got, verdict, detail):
    assert startup._compare([1, 2, 3], got)[0] == verdict
    assert detail in startup._compare([1, 2, 3], got)[1]


def findings(reports, **settings):
    s = Settings(**settings)
    return [*startup_findings.reachability(reports), *startup_findings.agreement(reports, s), *startup_findings.transfer(reports),
            *startup_findings.roles(reports), *startup_findings.decoder_ttl(reports, s),
            *startup_findings.parity(reports, object(), [1]), *startup_findings.store(s, True)]


@pytest.mark.parametrize(("reports", "settings", "level", "words"), [
    ([engine(), engine("decode")], {}, None, []),
    ([engine(), engine("decode", reachable=False)], {}, "fail", "no decode engine"),
    ([engine(), engine(url="http://p2:1", reachable=False), engine("decode")], {}, "warn", "not answering"),
    ([engine(), engine("decode", version="0.31.0")], {}, "fail", "different vLLM versions"),
    ([engine(), engine("decode", block_size=128)], {}, "fail", "block size"),
    ([engine(), engine("decode")], {"block_size": 32}, "fail", "block_size is set to 32"),
    ([engine(), engine("decode", models=["other"])], {}, "fail", "different models"),
    ([engine(), engine("decode")], {"model": "x"}, "fail", "not served"),
    ([engine(), engine("decode", kv_transfer={**KV, "bidirectional": False, "failure_policy": "fail"})], {},
     "fail", "bidirectional_kv_xfer is off"),
    ([engine(kv_transfer=None), engine("decode")], {}, "warn", "VLLM_SERVER_DEV_MODE"),
    ([engine(kv_transfer={**KV, "role": "kv_producer", "failure_policy": "recompute"}), engine("decode")], {},
     "fail", "kv_load_failure_policy 'recompute'"),
    ([engine(), engine("decode", kv_transfer={**KV, "role": "kv_consumer", "failure_policy": "recompute"})], {},
     "warn", "kv_load_failure_policy 'recompute'"),
    ([engine(kv_transfer={**KV, "role": "kv_producer", "bidirectional": False, "failure_policy": "fail"}),
      engine("decode")], {}, "fail", "bidirectional_kv_xfer is off on http://prefill:1"),
    ([engine(), engine("decode")], {"decoder_kv_blocks_ttl_s": 900}, "fail", "decoder_kv_blocks_ttl 480 s"),
    ([engine(), engine("decode", kv_transfer={**KV, "role": "kv_consumer", "failure_policy": "fail"})],
     {"decoder_kv_blocks_ttl_s": 900}, "fail", "decoder_kv_blocks_ttl 480 s"),       # absent: vLLM's default
    ([engine(kv_transfer={**KV, "role": "kv_consumer", "failure_policy": "fail"}),
      engine("decode", kv_transfer={**KV, "role": "kv_producer", "failure_policy": "fail"})], {}, "fail", "swapped"),
    ([engine(kv_transfer={**KV, "role": "kv_both", "failure_policy": "fail"}), engine("decode")], {}, None, []),
    ([engine(), engine("decode", parity="mismatch", parity_detail="first difference at token 3")], {},
     "fail", "token 3"),
    ([engine(parity="unknown"), engine("decode")], {}, "warn", "template parity unknown"),
])
def test_findings(reports, settings, level, words):
    found = findings(reports, **settings)
    if level is None:
        assert found == []
    else:
        assert any(f.level == level and words in f.text for f in found), found


def test_verdict_is_the_worst_finding():
    report = startup.StartupReport([engine()], "embedded", True, ["m"], 16, 32768, "on", [])
    assert report.verdict == "ok"
    report.findings = [startup.Finding("warn", "a"), startup.Finding("fail", "b")]
    assert report.verdict == "fail"
    assert report.lines()[-1] == "  fail: b" and report.to_dict()["verdict"] == "fail"


@pytest.mark.parametrize(("reports", "settings", "store_ok", "starts"), [
    ([engine(), engine("decode")], {}, True, "on: a later turn reuses D's KV if it comes within 450 s"),
    ([engine(), engine("decode", kv_transfer={**KV, "bidirectional": False})], {}, True, "off"),
    ([engine(), engine("decode")], {}, False, "degraded"),
])
def test_reuse_sentence(reports, settings, store_ok, starts):
    assert startup_findings.reuse(reports, Settings(**settings), store_ok).startswith(starts)


def test_reuse_sentence_names_the_store_scope():
    assert "--redis-url" in startup_findings.reuse([engine()], Settings(), True)
    assert "any gateway replica" in startup_findings.reuse([engine()], Settings(redis_url="redis://r:6379"), True)


# -- push mode (docs/protocol.md §8) --------------------------------------------------------------------------
PUSH_KV = {"connector": "NixlPushConnector", "bidirectional": False, "failure_policy": "fail"}


def push_engine(role="prefill", **kw) -> EngineReport:
    kv_role = {"prefill": "kv_producer", "decode": "kv_consumer"}[role]
    return engine(role, kv_transfer={**PUSH_KV, "role": kv_role}, **kw)


def test_push_mode_needs_no_bidirectional_transfer_and_reports_its_identities():
    from gateway.engines.transfer import Seen, decide
    reports = [push_engine(push_identity="p0@h:5600 tp 1 pp 1"), push_engine("decode")]
    mode = decide("auto", [Seen(r.role, r.url, "push") for r in reports])
    assert startup_findings.transfer(reports, mode) == []
    assert "push identity p0@h:5600" in reports[0].line()
    unlearned = startup_findings.transfer([push_engine(), push_engine("decode")], mode)
    assert [f.level for f in unlearned] == ["warn"] and "push identity not learned" in unlearned[0].text


def test_a_refused_mode_is_a_failing_finding():
    from gateway.engines.transfer import Seen, decide
    reports = [push_engine(), engine("decode")]
    mode = decide("auto", [Seen("prefill", "http://prefill:1", "push"), Seen("decode", "http://decode:1", "pull")])
    found = startup_findings.transfer(reports, mode)
    assert any(f.level == "fail" and "mixed KV-transfer modes" in f.text for f in found)


@pytest.mark.parametrize(("settings", "store_ok", "words"), [
    ({}, True, "a later turn goes to the same D alone (local) when D would compute at most 8192"),
    ({"local_prefill_max_tokens": 0}, True, "the local path is off"),
    ({}, False, "degraded"),
])
def test_push_reuse_sentence(settings, store_ok, words):
    sentence = startup_findings.reuse([push_engine(), push_engine("decode")], Settings(**settings), store_ok, push=True)
    assert words in sentence and (sentence.startswith("push:") or not store_ok)
