"""`pd-gateway verify` against real vLLM 0.32 P and D (CPU, NIXL) and the tier's co-located baseline: every case
passes, both negative controls are caught by the measure, and the run leaves D holding no KV for it. Then the
data plane of the same engines on the gateway: every `pdgw_engine_*` family for P and D, under the names and
types the simulator exports too."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.engines import dataplane
from gateway.sim.engine_core import Engine as SimEngine
from gateway.sim.metrics import render_metrics
from gateway.sim.chat_render import Renderer
from gateway.sim.settings import SimSettings
from gateway.telemetry import ENGINE_FAMILIES
from tests.vllm.conftest import ADMIN_KEY

# what the health loop reads, as real vLLM names and types them (and the simulator must too)
READ = ("vllm:nixl_xfer_time_seconds", "vllm:nixl_bytes_transferred", "vllm:nixl_num_descriptors",
        "vllm:nixl_num_failed_transfers", "vllm:nixl_num_kv_expired_reqs", "vllm:kv_cache_usage_perc",
        "vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:num_preemptions")


def _families(text: str) -> dict[str, str]:
    return {f.name: f.type for f in text_string_to_metric_families(text) if f.name in READ}

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

    # the data plane: real vLLM's names and types are the simulator's, and the gateway serves them per engine
    page = urllib.request.urlopen(engines.decode.url + "/metrics", timeout=10).read().decode()
    began = time.perf_counter()
    _, readings = dataplane.parse(page)
    print(f"D's /metrics: {len(page)} bytes, read in {(time.perf_counter() - began) * 1e3:.2f} ms")
    sim = SimEngine(SimSettings(role="decode"), Renderer("builtin:demo"))
    assert _families(page) == _families(render_metrics(sim)) and len(_families(page)) == len(READ)
    assert readings.nixl_xfer_seconds is not None and readings.nixl_xfer_seconds.count > 0   # D read P's KV
    metrics = urllib.request.Request(gateway.url + "/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    text = urllib.request.urlopen(metrics, timeout=10).read().decode()
    served = {f.name: f for f in text_string_to_metric_families(text)}
    for _, name, kind, _ in ENGINE_FAMILIES:
        family = served[name.removesuffix("_total")]
        assert family.type == kind
        assert {s.labels["engine"] for s in family.samples} == {"prefill-0", "decode-0"}, name   # never URLs
    request = urllib.request.Request(gateway.url + "/admin/engines", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    described = {e["url"]: e for e in json.loads(urllib.request.urlopen(request, timeout=10).read())["engines"]}
    nixl = described[engines.decode.url]["data_plane"]["nixl"]
    print(f"D's data plane: {nixl}")
    assert nixl["transfers"] > 0 and nixl["bytes_per_transfer"] > 0 and nixl["descriptors_per_transfer"] > 0
