"""Each harness, unchanged, for a multi-request session through the gateway: every request answered 200, the
main loop's later requests reuse D's KV. How each is pointed at the gateway is the README's "Agent harnesses"
section; what each reaches for outside and how it is stopped, docs/harnesses.md."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.harness.conftest import assert_answered_and_reused, base_env, run
from tests.harness.recorder import Recorder

pytestmark = pytest.mark.harness

FIRST = "Look around this project and tell me what is in it."
SECOND = "Thanks. Now check the weather in Zürich for me."
THIRD = "And what should I pack for it?"


def _ok(done, gateway: Recorder) -> None:
    """The harness exited 0; else its output and every request it made, with what the gateway did."""
    calls = "\n".join(f"{e} messages={len(e.body.get('messages') or e.body.get('input') or ())}"
                      for e in gateway.exchanges)
    assert done.returncode == 0, (f"exit {done.returncode}\nstdout:\n{done.stdout[-3000:]}\n"
                                  f"stderr:\n{done.stderr[-3000:]}\nrequests:\n{calls}")


def test_claude_code(harness_bin: Path, gateway: Recorder, tmp_path: Path) -> None:
    env = base_env(tmp_path / "home", harness_bin) | {
        "ANTHROPIC_BASE_URL": gateway.url, "ANTHROPIC_API_KEY": "sk-unused",
        "ANTHROPIC_MODEL": "demo", "ANTHROPIC_DEFAULT_HAIKU_MODEL": "demo", "ANTHROPIC_SMALL_FAST_MODEL": "demo",
        # no telemetry, error reports, update checks or other calls to Anthropic
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1", "DISABLE_ERROR_REPORTING": "1",
        "DISABLE_AUTOUPDATER": "1"}
    for extra in ([FIRST], [SECOND, "--continue"], [THIRD, "--continue"]):
        done = run(["claude", "-p", *extra, "--output-format", "json", "--max-turns", "8"],
                   cwd=tmp_path / "work", env=env)
        _ok(done, gateway)
        assert not json.loads(done.stdout)["is_error"], done.stdout
    assert_answered_and_reused(gateway)


CODEX_CONFIG = """
model = "demo"
model_provider = "pdgw"
check_for_update_on_startup = false

[model_providers.pdgw]
name = "pd-gateway"
base_url = "{url}/v1"
wire_api = "responses"
env_key = "PDGW_API_KEY"

[analytics]
enabled = false

[features]
plugins = false
remote_plugin = false
apps = false
"""


def test_codex_cli(harness_bin: Path, gateway: Recorder, tmp_path: Path) -> None:
    codex_home = tmp_path / "codex"
    codex_home.mkdir()
    (codex_home / "config.toml").write_text(CODEX_CONFIG.format(url=gateway.url))
    env = base_env(tmp_path / "home", harness_bin) | {"CODEX_HOME": str(codex_home), "PDGW_API_KEY": "unused"}
    _ok(run(["codex", "exec", "--skip-git-repo-check", FIRST], cwd=tmp_path / "work", env=env), gateway)
    for question in (SECOND, THIRD):
        _ok(run(["codex", "exec", "--skip-git-repo-check", "resume", "--last", question], cwd=tmp_path / "work",
                env=env), gateway)
    assert_answered_and_reused(gateway)


def opencode_config(url: str) -> dict:
    return {"$schema": "https://opencode.ai/config.json",
            "provider": {"pdgw": {"npm": "@ai-sdk/openai-compatible", "name": "pd-gateway",
                                  "options": {"baseURL": url + "/v1", "apiKey": "unused"},
                                  "models": {"demo": {"name": "demo",
                                                      "limit": {"context": 131072, "output": 32000}}}}},
            "model": "pdgw/demo", "small_model": "pdgw/demo", "autoupdate": False, "share": "disabled"}


def test_opencode(harness_bin: Path, gateway: Recorder, tmp_path: Path) -> None:
    config = tmp_path / "opencode.json"
    config.write_text(json.dumps(opencode_config(gateway.url)))
    env = base_env(tmp_path / "home", harness_bin) | {
        "OPENCODE_CONFIG": str(config),
        # no models.dev catalog, update check, default plugins, LSP downloads or sharing
        "OPENCODE_DISABLE_MODELS_FETCH": "1", "OPENCODE_DISABLE_AUTOUPDATE": "1",
        "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1", "OPENCODE_DISABLE_LSP_DOWNLOAD": "1", "OPENCODE_DISABLE_SHARE": "1",
        "npm_config_offline": "true"}    # its config folder's `@opencode-ai/plugin` install: from the cache only
    _ok(run(["opencode", "run", FIRST], cwd=tmp_path / "work", env=env), gateway)
    for question in (SECOND, THIRD):
        _ok(run(["opencode", "run", "--continue", question], cwd=tmp_path / "work", env=env), gateway)
    assert_answered_and_reused(gateway)


def test_openai_agents(gateway: Recorder) -> None:
    """The SDK's default Runner: the Responses API, store left true, the whole input resent each turn, no
    previous_response_id and no session header."""
    from agents import Agent, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)          # else traces are exported to api.openai.com

    @function_tool
    def weather(city: str) -> str:
        """The weather now in a city."""
        return json.dumps({"city": city, "celsius": 21, "sky": "clear"})

    client = AsyncOpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    agent = Agent(name="assistant", instructions="You are a helpful assistant. Use tools when they help.",
                  tools=[weather], model=OpenAIResponsesModel("demo", client))
    items: list = []
    for question in (FIRST, SECOND, THIRD):
        result = Runner.run_sync(agent, items + [{"role": "user", "content": question}])
        assert result.final_output
        items = result.to_input_list()
    assert_answered_and_reused(gateway)
