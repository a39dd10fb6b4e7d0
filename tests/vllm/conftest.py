"""The `vllm` tier's fixtures: its own venv (scripts/vllm-env), the tiny model, real vLLM engines and a gateway.

Run with `python -m pytest -m vllm tests/vllm` (the default run deselects the marker; each module here sets
`pytestmark = pytest.mark.vllm`). If the venv cannot be built on this machine the whole tier is skipped, loudly, with the
reason; a venv that builds but engines that do not start is a failure.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.servers import Server, start
from tests.vllm.engines import LOCAL_LEASE_S, PIN_TTL_S, TOOL_FLAGS, Engine, launch, wait_healthy

ROOT = Path(__file__).resolve().parents[2]
BUILD_TIMEOUT_S = 900
HANDLE_TTL_MARGIN_S = 8          # the gateway stops using a D handle 8 s before D unpins it
ADMIN_KEY = "vllm-tier-admin"    # the admin API on: `pd-gateway verify` deletes its conversations through it


@pytest.fixture(scope="session")
def vllm_python() -> str:
    try:
        done = subprocess.run([str(ROOT / "scripts" / "vllm-env")], capture_output=True, text=True,
                              timeout=BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        _skip_loudly(f"scripts/vllm-env did not finish in {BUILD_TIMEOUT_S}s")
    if done.returncode != 0:
        _skip_loudly(f"scripts/vllm-env exited {done.returncode}:\n{done.stderr[-3000:]}")
    return done.stdout.strip().splitlines()[-1]


def _skip_loudly(reason: str) -> None:
    banner = "=" * 100
    message = f"\n{banner}\nTHE VLLM TIER IS SKIPPED: its vLLM environment could not be built.\n{reason}\n{banner}"
    print(message, file=sys.stderr)
    pytest.skip(message)


@pytest.fixture(scope="session")
def model_dir(vllm_python: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The constrained model: its replies re-tokenize to the ids it generated."""
    return _make_model(vllm_python, tmp_path_factory.mktemp("tiny-qwen2"))


@pytest.fixture(scope="session")
def free_model_dir(vllm_python: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The unconstrained model: any token, so its replies seldom re-tokenize to the ids it generated."""
    return _make_model(vllm_python, tmp_path_factory.mktemp("tiny-qwen2-free"), "--unconstrained")


def _make_model(python: str, out: Path, *flags: str) -> Path:
    subprocess.run([python, str(ROOT / "tests" / "vllm" / "make_model.py"), str(out), *flags], check=True,
                   capture_output=True, timeout=120)
    return out


@pytest.fixture(scope="session")
def log_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="pdgw-vllm-"))


class Engines:
    """P, D and a co-located baseline (no connector), plus the odd engines the findings need, and a P and D
    serving the unconstrained model (its P doubles as that model's co-located baseline: a request without
    kv_transfer_params and with a fresh cache salt is computed there alone; one engine less on 2 cores)."""

    prefill: Engine
    decode: Engine
    baseline: Engine
    prefill_fail: Engine
    prefill_oneway: Engine
    free_prefill: Engine
    free_decode: Engine

    def __init__(self, python: str, model: Path, logs: Path) -> None:
        self.python, self.model, self.logs = python, model, logs
        self.all: list[Engine] = []

    def start(self, role, engine_id: str, model: Path | None = None, **kw) -> Engine:
        self.all.append(launch(self.python, model or self.model, role, engine_id, self.logs, **kw))
        return self.all[-1]

    def stop(self) -> None:
        for engine in reversed(self.all):
            engine.stop()


@pytest.fixture(scope="session")
def engines(vllm_python: str, model_dir: Path, free_model_dir: Path, log_dir: Path) -> Iterator[Engines]:
    pool = Engines(vllm_python, model_dir, log_dir)
    try:
        pool.prefill = pool.start("prefill", "p0", flags=TOOL_FLAGS)
        pool.decode = pool.start("decode", "d0", flags=TOOL_FLAGS)
        pool.baseline = pool.start("colocated", "baseline", flags=TOOL_FLAGS)
        # For PROTOCOL.md's open points (tests/vllm/test_findings.py): P under `fail`, P without bidirectional.
        pool.prefill_fail = pool.start("prefill", "p-fail", policy="fail")
        pool.prefill_oneway = pool.start("prefill", "p-oneway", bidirectional=False)
        pool.free_prefill = pool.start("prefill", "p-free", free_model_dir)
        pool.free_decode = pool.start("decode", "d-free", free_model_dir)
        wait_healthy(pool.all)
        yield pool
    finally:
        pool.stop()


@pytest.fixture(scope="session")
def gateway(engines: Engines, model_dir: Path) -> Iterator[Server]:
    """In front of the constrained model's P and D, in the default history mode."""
    yield from _gateway(engines.prefill, engines.decode, model_dir)


@pytest.fixture(scope="session")
def free_gateway(engines: Engines, free_model_dir: Path) -> Iterator[Server]:
    """In front of the unconstrained model's P and D, in the default history mode."""
    yield from _gateway(engines.free_prefill, engines.free_decode, free_model_dir)


@pytest.fixture(scope="session")
def free_gateway_local(engines: Engines, free_model_dir: Path) -> Iterator[Server]:
    """The same engines with the local path on (D alone computes short suffixes; D's lease is its pin TTL)."""
    yield from _gateway(engines.free_prefill, engines.free_decode, free_model_dir, "--local-prefill-max-tokens",
                        "256", "--decode-kv-lease-s", str(LOCAL_LEASE_S), "--prefill-handle-timeout-s", "8")


@pytest.fixture(scope="session")
def free_gateway_rendered(engines: Engines, free_model_dir: Path) -> Iterator[Server]:
    yield from _gateway(engines.free_prefill, engines.free_decode, free_model_dir, "--history-tokens", "rendered")


def _gateway(prefill: Engine, decode: Engine, model: Path, *flags: str) -> Iterator[Server]:
    server = start(["serve", "--tokenizer", str(model), "--prefill", prefill.url, "--decode", decode.url,
                    "--decoder-kv-blocks-ttl-s", str(PIN_TTL_S), "--handle-ttl-margin-s", str(HANDLE_TTL_MARGIN_S),
                    "--health-interval-s", "1", "--reuse-policy", "always", "--local-prefill-max-tokens", "0",
                    "--admin-key", ADMIN_KEY, *flags])
    try:
        yield server
    finally:
        server.stop()
