"""Real vLLM engines for the `vllm` tier: P (kv_producer), D (kv_consumer) and a co-located baseline without a
connector, started from the tier's own venv, waited for on /health within a bound, stopped by PID.

The pinned configuration (why each setting is here: docs/vllm-cpu.md) lives in ENGINE_ENV and FLAGS.
"""

from __future__ import annotations

import json
import os
import random
import socket
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from tests.servers import stop_process


Role = Literal["prefill", "decode", "colocated"]

START_TIMEOUT_S = 240.0
STOP_TIMEOUT_S = 20.0
SERVED_MODEL = "tiny"
BLOCK_SIZE = 128                 # the CPU backend's KV block size
KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 64 * 4    # layers x (K, V) x KV heads x head_dim x float32
PIN_TTL_S = 20                   # decoder_kv_blocks_ttl on D: short, D's engine loop is busy while it pins
# kv_lease_duration on D, the same: a request sent to D alone with `do_remote_decode` (the local path,
# tests/vllm/test_local.py) is pinned as a producer lease for D's kv_lease_duration (vLLM's default 30 s),
# not for decoder_kv_blocks_ttl. Equal, one TTL covers every handle D returns. Nothing else on D changes but
# the interval of D's heartbeats to P (kv_lease_duration // 6: 3 s), well inside P's lease extension (20 s).
LOCAL_LEASE_S = PIN_TTL_S

# Every engine's environment: the pinned configuration of docs/vllm-cpu.md.
ENGINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",   # keeps the uni executor: the worker runs in the engine core's process
    "OMP_WAIT_POLICY": "PASSIVE",            # idle OpenMP threads sleep instead of spinning a shared core
    "NIXL_PTHR_DELAY_US": "100",             # NIXL's progress thread polls every 100 µs (tests/vllm/site/)
}
FLAGS = ["--enforce-eager", "--dtype", "float32", "--max-model-len", "2048",
         "--kv-cache-memory-bytes", str(64 * 1024 * 1024), "--served-model-name", SERVED_MODEL,
         "--disable-uvicorn-access-log"]
# For investigations: a JSON object of variables laid over ENGINE_ENV in every engine, e.g. to see the stall
# come back: VLLM_TIER_ENGINE_ENV='{"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}' pytest -m vllm tests/vllm/test_soak.py
OVERRIDE_ENV = "VLLM_TIER_ENGINE_ENV"
CPU = {"prefill": "0", "decode": "1", "colocated": "1"}      # VLLM_CPU_OMP_THREADS_BIND
# vLLM's Hermes tool-call parser (the demo template renders tools as Qwen/Hermes do): requests with `tools` and
# tool_choice "auto" are refused without it. The constrained model never emits <tool_call>, so answers stay text.
TOOL_FLAGS = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]


def kv_transfer_config(role: Role, engine_id: str, *, policy: str, bidirectional: bool = True,
                       pin_ttl_s: int = PIN_TTL_S, connector: str = "NixlConnector") -> dict[str, Any]:
    extra: dict[str, Any] = {"bidirectional_kv_xfer": bidirectional}
    if role == "decode":
        extra["decoder_kv_blocks_ttl"] = pin_ttl_s
        extra["kv_lease_duration"] = pin_ttl_s        # LOCAL_LEASE_S by default
    return {"kv_connector": connector, "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
            "engine_id": engine_id, "kv_buffer_device": "cpu", "kv_load_failure_policy": policy,
            "kv_connector_extra_config": extra}


@dataclass
class Engine:
    role: Role
    engine_id: str
    proc: subprocess.Popen
    port: int
    side_port: int | None
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def post(self, path: str, body: dict[str, Any], timeout_s: float = 120.0) -> dict[str, Any]:
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return json.loads(resp.read())

    def metrics(self) -> dict[str, float]:
        """`/metrics` as {'name{labels}': value}, labels as vLLM prints them."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as resp:
            text = resp.read().decode()
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                out[key] = float(value)
        return out

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of `name` whose labels include `labels` (0 when absent)."""
        total = 0.0
        for key, value in self.metrics().items():
            base, _, rest = key.partition("{")
            if base == name and all(f'{k}="{v}"' in rest for k, v in labels.items()):
                total += value
        return total

    def loaded_tokens(self) -> float:
        """Prompt tokens this engine took from the other engine's KV (vLLM's own count)."""
        return self.metric("vllm:prompt_tokens_by_source_total", source="external_kv_transfer")

    def computed_tokens(self) -> float:
        """Prompt tokens this engine computed itself (neither its prefix cache nor the other engine's KV)."""
        return self.metric("vllm:prompt_tokens_by_source_total", source="local_compute")

    def nixl_bytes(self) -> float:
        """Bytes this engine's NIXL reads moved (whole blocks)."""
        return self.metric("vllm:nixl_bytes_transferred_sum")

    def kv_usage(self) -> float:
        return self.metric("vllm:kv_cache_usage_perc")

    def cpu_seconds(self) -> float:
        """CPU time used so far by the server and all its child processes (engine core, worker)."""
        return sum(_cpu_seconds(pid) for pid in _tree(self.proc.pid))

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        """SIGTERM by PID; vLLM's API server takes its engine core and worker down with it."""
        if self.proc.poll() is None:
            children = _tree(self.proc.pid)[1:]
            stop_process(self.proc, timeout_s=STOP_TIMEOUT_S)
            for pid in children:                  # anything left of this server's own tree
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def launch(python: str, model: Path, role: Role, engine_id: str, log_dir: Path, *, policy: str = "recompute",
           bidirectional: bool = True, pin_ttl_s: int = PIN_TTL_S, env: dict[str, str] | None = None,
           flags: list[str] | None = None, connector: str = "NixlConnector") -> Engine:
    """Start one vLLM server; does not wait (see `wait_healthy`), so several can start at once."""
    port = _free_port()
    side_port = _free_port() if role != "colocated" else None
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
           "--port", str(port), *FLAGS, *(flags or [])]
    if role != "colocated":
        config = kv_transfer_config(role, engine_id, policy=policy, bidirectional=bidirectional,
                                    pin_ttl_s=pin_ttl_s, connector=connector)
        cmd += ["--kv-transfer-config", json.dumps(config)]
    full_env = {**_clean(os.environ), **ENGINE_ENV, "VLLM_CPU_OMP_THREADS_BIND": CPU[role],
                **json.loads(os.environ.get(OVERRIDE_ENV, "{}")), **(env or {})}
    if side_port is not None:
        full_env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(side_port)
    log_path = log_dir / f"{engine_id}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env, start_new_session=True)
    return Engine(role, engine_id, proc, port, side_port, log_path, full_env)


def wait_healthy(engines: list[Engine], timeout_s: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    waiting = list(engines)
    while waiting:
        for engine in list(waiting):
            if not engine.alive():
                raise RuntimeError(f"vLLM {engine.engine_id} exited {engine.proc.returncode}:\n{_tail(engine)}")
            if _answers(engine.url + "/health"):
                waiting.remove(engine)
        if waiting and time.monotonic() > deadline:
            raise TimeoutError(f"vLLM {waiting[0].engine_id} not healthy after {timeout_s:.0f}s:\n"
                               f"{_tail(waiting[0])}")
        time.sleep(0.5)


_taken: set[int] = set()


def _free_port() -> int:
    """A port below the kernel's ephemeral range (where vLLM's own internal sockets bind port 0), not handed out
    before in this session: vLLM cannot report a port-0 bind, and its side channel is bound late."""
    while True:
        port = random.randrange(20000, 32000)
        if port in _taken:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _taken.add(port)
        return port


def _clean(environ: os._Environ) -> dict[str, str]:
    """The test process's environment minus what would change vLLM's or the gateway's behaviour."""
    return {k: v for k, v in environ.items() if not k.startswith(("PDGW_", "VLLM_", "UCX_", "OMP_", "NIXL_"))}


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    except (OSError, urllib.error.URLError):
        return False


def _tail(engine: Engine, lines: int = 60) -> str:
    return "\n".join(engine.log().splitlines()[-lines:])


def _tree(pid: int) -> list[int]:
    """`pid` and its descendants, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat[stat.rindex(")") + 2:].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        current = todo.pop()
        out.append(current)
        todo += children.get(current, [])
    return out


_TICKS = os.sysconf("SC_CLK_TCK")


def _cpu_seconds(pid: int) -> float:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS

