"""What an operator sees, against simulated engines. `pd-gateway check`: a good pair passes; a dead P, a D without
bidirectional transfer and a chat template that renders differently each fail the verdict, with the reason
printed. `serve --log-format json`: every line is JSON, with the start-up report and one line per turn."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request

import pytest

from tests.servers import free_port, start

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def engines():
    servers = []
    try:
        for args in (["--role", "prefill", "--engine-id", "p0", "--kv-load-failure-policy", "fail"],
                     ["--role", "decode", "--engine-id", "d0"],
                     ["--role", "decode", "--engine-id", "d1", "--no-bidirectional"]):
            servers.append(start(["sim", *args]))
        yield servers
    finally:
        for server in servers:
            server.stop()


def check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gateway", "check", *args], capture_output=True, text=True,
                          timeout=120)


def test_a_matching_pair_passes(engines):
    prefill, decode, _ = engines
    result = check("--prefill", prefill.url, "--decode", decode.url)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "vLLM 0.32.0" in out and "block size 16" in out and "bidirectional on" in out
    assert out.count("template parity match") == 2
    assert "store    embedded (single process) (answers)" in out
    assert "reuse    on: a later turn reuses D's KV if it comes within 450 s" in out
    assert "verdict  ok" in out


def test_a_bad_set_up_fails_and_says_why(engines, tmp_path):
    _, _, no_bidi = engines
    template = tmp_path / "other.jinja"
    template.write_text("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:")
    result = check("--prefill", f"http://127.0.0.1:{free_port()}", "--decode", no_bidi.url,
                   "--chat-template", str(template), "--json")
    assert result.returncode == 1, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert report["verdict"] == "fail"
    texts = " | ".join(f["text"] for f in report["findings"] if f["level"] == "fail")
    assert "no prefill engine answers /health" in texts
    assert "bidirectional_kv_xfer is off" in texts
    assert "template parity" in texts and "renders the probe conversation differently" in texts
    assert report["reuse"].startswith("off")


@pytest.mark.parametrize("strict", [[], ["--strict"]])
def test_a_ttl_mismatch_and_swapped_urls_fail(engines, strict):
    prefill, decode, _ = engines
    ttl = check("--prefill", prefill.url, "--decode", decode.url, "--decoder-kv-blocks-ttl-s", "900", *strict)
    assert ttl.returncode == 1 and "verdict  fail" in ttl.stdout, ttl.stdout
    assert "decoder_kv_blocks_ttl 480 s but the gateway's --decoder-kv-blocks-ttl-s is 900 s" in ttl.stdout
    swapped = check("--prefill", decode.url, "--decode", prefill.url, *strict)
    assert swapped.returncode == 1 and "verdict  fail" in swapped.stdout, swapped.stdout
    assert "swapped" in swapped.stdout


def test_json_logs_with_the_report_and_one_line_per_turn(engines):
    prefill, decode, _ = engines
    gateway = start(["serve", "--prefill", prefill.url, "--decode", decode.url, "--log-format", "json"])
    try:
        body = json.dumps({"model": "demo", "messages": [{"role": "user", "content": "Hi there"}]}).encode()
        request = urllib.request.Request(gateway.url + "/v1/chat/completions", body, method="POST",
                                         headers={"Content-Type": "application/json", "X-Session-Id": "logs"})
        with urllib.request.urlopen(request, timeout=30) as response:
            assert response.status == 200
    finally:
        gateway.stop()
    lines = [json.loads(line) for line in gateway.log().splitlines() if line.strip()]
    report = next(line for line in lines if line["logger"] == "gateway.startup")
    assert report["startup_report"]["verdict"] == "ok" and report["level"] == "info"
    turns = [line for line in lines if line["logger"] == "gateway.turn" and line["message"].startswith("turn ")]
    assert [(t["level"], t["plan"], t["reason"]) for t in turns] == [("info", "full", "first_turn")]
    assert turns[0]["computed"] > 0 and turns[0]["reused"] == 0
