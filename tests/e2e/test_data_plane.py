"""The data plane in one place: the gateway's health loop scrapes each engine's NIXL and KV metrics (the
simulator exports them under vLLM 0.32's names) and serves them per engine on its own /metrics, beside its
per-leg timings, and in `/admin/engines`; the page is clean for promtool and for prometheus_client's parser."""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.stack import stack
from gateway.telemetry import ENGINE_FAMILIES

pytestmark = pytest.mark.integration

ADMIN = "dp-admin"
LONG = "Tell me about the river and the stone, and the bridge over the valley. " * 12   # > recompute threshold


def scrape(url: str, admin: str | None = ADMIN) -> str:
    """With a key configured, /metrics needs the admin key (docs/operations.md#paths-and-who-may-call-them)."""
    request = urllib.request.Request(url + "/metrics", headers={"Authorization": f"Bearer {admin}"} if admin else {})
    return urllib.request.urlopen(request, timeout=5).read().decode()


def transfers(text: str, pool: str, engine: str) -> float:
    families = {f.name: f for f in text_string_to_metric_families(text)}
    family = families.get("pdgw_engine_nixl_transfer_seconds")
    return sum(s.value for s in family.samples if s.name.endswith("_count")
               and s.labels == {"pool": pool, "engine": engine}) if family else 0.0


def test_every_engines_data_plane_on_the_gateways_metrics_and_admin_api():
    # answers longer than kv_recompute_threshold: P reads them from D on turn 2 instead of recomputing them
    with stack(sim=["--output-tokens", "80:100"], gateway=["--admin-key", ADMIN]) as s:
        client = s.client()
        messages = [{"role": "user", "content": LONG}]
        for question in ("And then?" * 30, "Thanks."):          # turn 2 reuses: P reads D's KV
            answer = client.chat.completions.create(model="demo", messages=messages, max_tokens=120,
                                                    extra_headers={"X-Session-Id": "dp"})
            messages += [{"role": "assistant", "content": answer.choices[0].message.content},
                         {"role": "user", "content": question}]
        p, d = s.prefill[0].url, s.decode[0].url
        p_name, d_name = "prefill-0", "decode-0"        # labels name engines, never by URL (issue 38)
        # D read P's KV on both turns, P read D's on the second: each reader's NIXL time, per engine
        s.wait_until(lambda: transfers(scrape(s.gateway.url), "decode", d_name) >= 2
                     and transfers(scrape(s.gateway.url), "prefill", p_name) >= 1, timeout_s=15)
        text = scrape(s.gateway.url)
        families = {f.name: f for f in text_string_to_metric_families(text)}
        for _, name, kind, _ in ENGINE_FAMILIES:
            family = families[name.removesuffix("_total")]
            assert family.type == kind
            assert {(x.labels["pool"], x.labels["engine"]) for x in family.samples} == \
                {("prefill", p_name), ("decode", d_name)}
        assert "127.0.0.1" not in text
        assert "pdgw_turn_seconds" in families and "pdgw_gateway_seconds" in families     # beside per-leg timings
        request = urllib.request.Request(s.gateway.url + "/admin/engines",
                                         headers={"Authorization": f"Bearer {ADMIN}"})
        engines = {e["url"]: e for e in get_json_request(request)["engines"]}
        nixl = engines[d]["data_plane"]["nixl"]
        assert nixl["transfers"] >= 2 and nixl["bytes_per_transfer"] > 0 and nixl["descriptors_per_transfer"] > 0
        assert nixl["transfer_seconds_p90"] is not None and nixl["failed_transfers"] == 0
        assert 0 <= engines[d]["data_plane"]["kv_cache_usage"] <= 1
        assert engines[p]["data_plane"]["requests_waiting"] == 0
        promtool = shutil.which("promtool")
        if promtool is None:                 # Debian's `prometheus` package ships it; the parser above ran anyway
            pytest.skip("promtool not installed: checked with prometheus_client's parser only")
        lint = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
        assert lint.returncode == 0 and not lint.stdout.strip() and not lint.stderr.strip(), lint.stdout + lint.stderr


def get_json_request(request: urllib.request.Request) -> dict:
    with urllib.request.urlopen(request, timeout=5) as resp:
        return json.loads(resp.read())


def test_an_engine_that_stops_answering_drops_its_readings():
    with stack() as s:
        d = "decode-0"
        s.wait_until(lambda: f'pdgw_engine_kv_cache_usage_ratio{{engine="{d}",pool="decode"}}' in
                     scrape(s.gateway.url, None))
        s.decode[0].stop()
        s.wait_until(lambda: f'engine="{d}",pool="decode"}}' not in "\n".join(    # nothing stale is served
            line for line in scrape(s.gateway.url, None).splitlines()
            if line.startswith("pdgw_engine_") and not line.startswith("pdgw_engine_healthy")), timeout_s=20)
