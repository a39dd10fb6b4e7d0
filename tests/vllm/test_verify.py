"""`pd-gateway verify` against real vLLM 0.32 P and D (CPU, NIXL) and the tier's co-located baseline: every case
passes, both negative controls are caught by the measure, and the run leaves D holding no KV for it."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from tests.vllm.conftest import ADMIN_KEY

pytestmark = pytest.mark.vllm


def test_verify_passes_on_real_vllm(engines, gateway):
    cmd = [sys.executable, "-m", "gateway", "verify", "--gateway", gateway.url, "--prefill", engines.prefill.url,
           "--decode", engines.decode.url, "--baseline", engines.baseline.url, "--admin-key", ADMIN_KEY, "--json"]
    began = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    report = json.loads(done.stdout)
    print(f"verify took {time.monotonic() - began:.0f} s: {report['summary']}")
    for verdict in report["verdicts"]:
        print(f"  {verdict['name']:<36} {verdict['status']:<8} {verdict['how']:<9} {verdict['max_abs']} "
              f"{verdict['note']} {verdict['detail']}")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    cases = [v for v in report["verdicts"] if not v["expect_wrong"]]
    assert sum(v["status"] == "pass" for v in cases) >= len(cases) - 2       # at most tools / schema skipped
    assert not [v for v in cases if v["status"] == "flagged"]
    controls = [v for v in report["verdicts"] if v["expect_wrong"]]
    assert len(controls) == 2 and all(v["as_expected"] for v in controls)
    assert report["conversations_deleted"] == report["conversations"]
    # the conversations' handles released through the admin API, the controls' spent: D's KV drains at once,
    # not at decoder_kv_blocks_ttl (the tier's D usage is 0 when nothing is pinned or running)
    deadline = time.monotonic() + 15
    while engines.decode.kv_usage() > 0 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert engines.decode.kv_usage() == 0
