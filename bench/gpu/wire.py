"""HTTP to the gateway and the engines (stdlib only), and vLLM's / the gateway's Prometheus counters."""

from __future__ import annotations

import http.client
import json
import time
import urllib.parse
from typing import Any

# Counters read around every request: what each engine computed, read from its cache, or loaded over NIXL,
# and what NIXL moved in how long (histogram sums and counts).
COUNTERS = {
    "external_kv_transfer": ("vllm:prompt_tokens_by_source_total", {"source": "external_kv_transfer"}),
    "local_cache_hit": ("vllm:prompt_tokens_by_source_total", {"source": "local_cache_hit"}),
    "local_compute": ("vllm:prompt_tokens_by_source_total", {"source": "local_compute"}),
    "nixl_bytes": ("vllm:nixl_bytes_transferred_sum", {}),
    "nixl_xfer_s": ("vllm:nixl_xfer_time_seconds_sum", {}),
    "nixl_xfers": ("vllm:nixl_xfer_time_seconds_count", {}),
    "nixl_failed": ("vllm:nixl_num_failed_transfers_total", {}),
    "prefill_s": ("vllm:request_prefill_time_seconds_sum", {}),
    "engine_ttft_s": ("vllm:time_to_first_token_seconds_sum", {}),
}


def _conn(url: str, timeout: float) -> tuple[http.client.HTTPConnection, str]:
    u = urllib.parse.urlsplit(url)
    return http.client.HTTPConnection(u.hostname, u.port, timeout=timeout), u.path.rstrip("/")


def post(url: str, path: str, body: dict[str, Any], headers: dict[str, str] | None = None,
         timeout: float = 300) -> tuple[int, dict[str, str], Any]:
    """One JSON request: (status, lower-cased headers, decoded body or text)."""
    conn, base = _conn(url, timeout)
    try:
        conn.request("POST", base + path, body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        raw = resp.read()
        try:
            payload: Any = json.loads(raw) if raw else None
        except ValueError:
            payload = raw.decode(errors="replace")
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, payload
    finally:
        conn.close()


def get_text(url: str, path: str, timeout: float = 30, headers: dict[str, str] | None = None) -> str:
    conn, base = _conn(url, timeout)
    try:
        conn.request("GET", base + path, headers=headers or {})
        return conn.getresponse().read().decode(errors="replace")
    finally:
        conn.close()


def stream_chat(url: str, body: dict[str, Any], headers: dict[str, str] | None = None,
                timeout: float = 300) -> dict[str, Any]:
    """A streamed chat completion; TTFT is the arrival of the first chunk with content."""
    conn, base = _conn(url, timeout)
    res: dict[str, Any] = {"status": None, "ttft": None, "text": "", "usage": None, "headers": {}, "error": None}
    t0 = time.perf_counter()
    try:
        conn.request("POST", base + "/v1/chat/completions", body=json.dumps({**body, "stream": True}).encode(),
                     headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        res["status"] = resp.status
        res["headers"] = {k.lower(): v for k, v in resp.getheaders() if k.lower().startswith("x-pd")}
        if resp.status != 200:
            res["error"] = resp.read().decode(errors="replace")[:500]
            return res
        pieces = []
        for line in iter(resp.readline, b""):
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            res["usage"] = chunk.get("usage") or res["usage"]
            for choice in chunk.get("choices") or ():
                content = (choice.get("delta") or {}).get("content") or ""
                if content and res["ttft"] is None:
                    res["ttft"] = time.perf_counter() - t0
                pieces.append(content)
        res["text"] = "".join(pieces)
    except (OSError, http.client.HTTPException, ValueError) as exc:
        res["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        res["total"] = time.perf_counter() - t0
        conn.close()
    return res


def metrics(url: str, admin_key: str | None = None) -> dict[str, float]:
    """Every vllm:/pdgw_ sample of /metrics, keyed by its line's name and labels; {} when unreachable.
    `admin_key`: a gateway with keys serves /metrics to its admin key only."""
    try:
        text = get_text(url, "/metrics", timeout=10,
                        headers={"Authorization": f"Bearer {admin_key}"} if admin_key else None)
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        if line.startswith(("vllm:", "pdgw_")):
            key, _, value = line.rpartition(" ")
            try:
                out[key] = float(value)
            except ValueError:
                pass
    return out


def msum(samples: dict[str, float], name: str, labels: dict[str, str]) -> float:
    total = 0.0
    for key, value in samples.items():
        base, _, rest = key.partition("{")
        if base == name and all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += value
    return total


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What one engine did between two reads of its counters."""
    return {key: round(msum(after, name, labels) - msum(before, name, labels), 6)
            for key, (name, labels) in COUNTERS.items()}


def gateway_phases(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Mean ms per phase of the gateway's turns between two reads of its /metrics."""
    out = {}
    for phase in ("intake", "plan", "prefill", "decode_ttft", "total"):
        label = {"phase": phase}
        n = msum(after, "pdgw_turn_seconds_count", label) - msum(before, "pdgw_turn_seconds_count", label)
        if n:
            s = msum(after, "pdgw_turn_seconds_sum", label) - msum(before, "pdgw_turn_seconds_sum", label)
            out[phase] = round(s / n * 1e3, 2)
    return out
