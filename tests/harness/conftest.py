"""The `harness` tier: real coding-agent harnesses, unchanged and pinned (Claude Code, Codex CLI and OpenCode
from npm, installed by scripts/harness-env into .harness/; openai-agents from PyPI), each run non-interactively
for a multi-request session against the gateway in front of simulated P and D with the demo's engine settings
(gateway/demo.py AGENT_READY). Between harness and gateway sits a recording proxy (recorder.py), so a test sees
every request and the gateway's X-PD-* answer headers.

Nothing may leave loopback: scripts/test-harness runs this tier in a network namespace of its own with only
`lo` (`unshare -rn`), and the tests skip outside one unless PDGW_HARNESS_ALLOW_NETWORK=1. Each harness also gets
its own settings that switch off what it reaches for otherwise (docs/harnesses.md lists them)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.demo import sim_flags
from tests.harness.recorder import Exchange, Recorder
from tests.servers import Server, start

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(os.environ.get("HARNESS_DIR", ROOT / ".harness")) / "node_modules" / ".bin"
RUN_TIMEOUT_S = 180


def loopback_only() -> bool:
    """True inside a network namespace whose only interface is loopback."""
    lines = Path("/proc/net/dev").read_text().splitlines()[2:]
    return [line.split(":")[0].strip() for line in lines] == ["lo"]


@pytest.fixture(scope="session", autouse=True)
def _isolated() -> None:
    if not loopback_only() and os.environ.get("PDGW_HARNESS_ALLOW_NETWORK") != "1":
        pytest.skip("the harness tier runs in a loopback-only network namespace: scripts/test-harness")


@pytest.fixture(scope="session")
def harness_bin() -> Path:
    missing = [c for c in ("claude", "codex", "opencode") if not (BIN / c).exists()]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed in {BIN.parent.parent}: run scripts/harness-env")
    return BIN


@pytest.fixture
def gateway() -> Iterator[Recorder]:
    """The demo's stack (simulated P and D, the gateway as `pd-gateway demo` starts it) behind a recorder, but
    for D's lease on a `local` turn's KV: 300 s instead of vLLM's 30, since a CLI's start-up on CI's 2 busy cores
    can space two turns by more than 30 s (`handle_expired`, a full prefill: right, but not what is tested here)."""
    lease = "300"
    servers: list[Server] = []
    try:
        for role in ("prefill", "decode"):
            servers.append(start(["sim", "--role", role, "--engine-id", role, *sim_flags("builtin:demo"),
                                  "--kv-lease-duration", lease]))
        servers.append(start(["serve", "--prefill", servers[0].url, "--decode", servers[1].url,
                              "--tokenizer", "builtin:demo", "--decode-kv-lease-s", lease, "--log-level", "info"]))
        with Recorder(servers[-1].url) as recorder:
            yield recorder
    finally:
        for server in reversed(servers):
            server.stop()


def base_env(home: Path, bin_dir: Path | None = None) -> dict[str, str]:
    """A clean environment: none of the host's keys, proxies or settings reach the harness."""
    home.mkdir(parents=True, exist_ok=True)
    path = ([str(bin_dir)] if bin_dir else []) + ["/usr/local/bin", "/usr/bin", "/bin"]
    return {"PATH": ":".join(path), "HOME": str(home), "LANG": "C.UTF-8", "TERM": "dumb", "NO_COLOR": "1"}


def run(cmd: list[str], *, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    cwd.mkdir(parents=True, exist_ok=True)
    return subprocess.run(cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S)


# -- what the tests assert ---------------------------------------------------------------------------------
def head(exchange: Exchange) -> str:
    """A request's conversation head: its system prompt (or instructions) and its tools' names. A harness's
    title or subagent requests have heads of their own; the main loop's requests share one."""
    body = exchange.body
    system: Any = body.get("system") or body.get("instructions") or [
        m.get("content") for m in body.get("messages") or () if m.get("role") in ("system", "developer")][:1]
    text = system if isinstance(system, str) else json.dumps(system, sort_keys=True)
    text = "\n".join(line for line in text.splitlines() if "billing-header" not in line)
    names = sorted(str(t.get("name") or (t.get("function") or {}).get("name") or t.get("type"))
                   for t in body.get("tools") or () if isinstance(t, dict))
    return hashlib.sha256((text + "\0" + ",".join(names)).encode()).hexdigest()[:12]


def conversations(calls: list[Exchange]) -> dict[str, list[Exchange]]:
    grouped: dict[str, list[Exchange]] = {}
    for call in calls:
        grouped.setdefault(head(call), []).append(call)
    return grouped


def assert_answered_and_reused(recorder: Recorder, *, min_calls: int = 3) -> None:
    """Every model request the harness made was answered 200; its main loop made several; each conversation's first
    request was a first turn (a title request on the main loop's session id is a conversation of its own) and
    each one after the first reused D's KV (reused tokens > 0 in the gateway's X-PD-Reused-Tokens)."""
    log = "\n".join(str(e) for e in recorder.exchanges)
    print(log)                           # shown with a failure, and with -rP
    calls = recorder.model_calls
    assert calls and all(e.status == 200 for e in calls), log
    # anything else (Claude Code's `HEAD /` reachability probe: 404, as on Anthropic's API) is no server error
    assert all(e.status < 500 for e in recorder.exchanges), log
    assert len(calls) >= min_calls, log
    main = max(conversations(calls).values(), key=len)
    assert len(main) >= 2, log
    for conversation in conversations(calls).values():
        # a title or subagent request is a conversation of its own, not a divergence of the main loop's
        assert conversation[0].reason != "prefix_diverged", log
        assert all(e.reused > 0 for e in conversation[1:]), log
