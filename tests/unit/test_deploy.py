"""compose.yaml, the Dockerfile, deploy/ and the Grafana dashboard, checked without Docker.

- compose.yaml validates against the Compose Specification's JSON schema, raw and interpolated.
  `tests/data/compose-spec.json` is that schema (compose-spec/compose-spec, Apache-2.0) as shipped in the npm
  package dclint 3.1.0 (`schemas/compose.schema.json`).
- Every command of our image parses with the real parsers (`gateway.cli`, `gateway.sim.launch`), every PDGW_*
  variable names a real setting with a valid value, and the URLs, ports and hosts agree across services.
- deploy/vllm-serve.sh runs (with a stand-in `vllm`) and gives P and D the docs/protocol.md §1 flags, with the
  TTLs the gateway uses.
- The dashboard's JSON is well formed for Grafana and only queries metrics that exist.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import msgspec
import pytest
import yaml

from gateway import cli, config, demo
from gateway.sim import launch as sim_cli
from gateway.telemetry import Metrics

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "compose.yaml").read_text())
SERVICES: dict[str, dict[str, Any]] = COMPOSE["services"]
DASHBOARDS = {p.name: json.loads(p.read_text()) for p in sorted((ROOT / "deploy/grafana/dashboards").glob("*.json"))}
DASHBOARD = DASHBOARDS["pd-gateway.json"]
OUR_IMAGE = "pd-gateway:local"
PROFILES = {
    "sim": {"redis", "migrate", "sim-prefill", "sim-decode", "gateway"},
    "vllm": {"redis", "migrate", "prefill", "decode", "gateway-vllm"},
    "observability": {"prometheus", "grafana"},
}
GATEWAYS = {"sim": "gateway", "vllm": "gateway-vllm"}


# -- helpers -----------------------------------------------------------------------------------------
def read_env_file(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            out[key.strip()] = value.strip()
    return out


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose's `${VAR}`, `${VAR:-default}` and `$$`, applied to every string."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value
    value = re.sub(r"\$\{(\w+)(?::-([^}]*))?\}", lambda m: env.get(m.group(1)) or m.group(2) or "", value)
    return value.replace("$$", "$")


def service_env(name: str) -> dict[str, str]:
    """What the container sees: env_file entries, then `environment` over them."""
    service = SERVICES[name]
    env: dict[str, str] = {}
    for path in service.get("env_file") or []:
        env.update(read_env_file(ROOT / path))
    env.update({k: str(v) for k, v in (service.get("environment") or {}).items()})
    return interpolate(env, {})


def ours() -> list[str]:
    return [name for name, s in SERVICES.items() if s.get("image") == OUR_IMAGE]


def gateway_settings(name: str) -> config.Settings:
    command = SERVICES[name]["command"]
    args = cli.settings_parser("pd-gateway serve").parse_args(command[1:])
    flags = {k: v for k, v in vars(args).items() if k not in cli.NOT_SETTINGS}
    return config.build(flags, None, service_env(name))


def sim_args(name: str):
    return sim_cli.parser().parse_args(SERVICES[name]["command"][1:])


def health_url(name: str) -> str:
    test = " ".join(SERVICES[name]["healthcheck"]["test"])
    return re.search(r"https?://[\w.-]+:\d+/\w+", test).group(0)


def vllm_argv(name: str, tmp_path: Path) -> list[str]:
    """Run deploy/vllm-serve.sh as the container would, with a `vllm` that prints its argv as JSON."""
    fake = tmp_path / "vllm"
    fake.write_text('#!/usr/bin/env python3\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n')
    fake.chmod(0o755)
    env = {"PATH": f"{tmp_path}:{os.environ['PATH']}", **service_env(name)}
    entry = SERVICES[name]["entrypoint"]
    script = str(ROOT / "deploy" / Path(entry[1]).name)
    result = subprocess.run([entry[0], script, *SERVICES[name]["command"]], env=env, capture_output=True,
                            text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


# -- compose against the specification ---------------------------------------------------------------
@pytest.fixture(scope="module")
def validator() -> jsonschema.Draft7Validator:
    schema = json.loads((ROOT / "tests/data/compose-spec.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


@pytest.mark.parametrize("interpolated", [False, True])
def test_compose_validates_against_the_compose_specification(validator, interpolated):
    document = interpolate(COMPOSE, read_env_file(ROOT / ".env")) if interpolated else COMPOSE
    errors = sorted(validator.iter_errors(document), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{'/'.join(map(str, e.path))}: {e.message}" for e in errors)


def test_the_schema_catches_mistakes(validator):
    broken = {"services": {"gateway": {"image": 5, "healthcheck": {"tset": 1}}}}
    assert len(list(validator.iter_errors(broken))) >= 2


def test_profiles_and_the_default():
    for profile, names in PROFILES.items():
        assert {n for n, s in SERVICES.items() if profile in s.get("profiles", [])} == names, profile
    assert all(s.get("profiles") for s in SERVICES.values()), "an unprofiled service would start in every stack"
    assert read_env_file(ROOT / ".env")["COMPOSE_PROFILES"] == "sim"


def test_gateways_answer_on_localhost_8000():
    for name in GATEWAYS.values():
        assert SERVICES[name]["ports"] == ["127.0.0.1:8000:8000"]
        assert gateway_settings(name).port == 8000 and gateway_settings(name).host == "0.0.0.0"


def test_healthchecks_on_every_long_running_service_of_the_stacks():
    for name in (PROFILES["sim"] | PROFILES["vllm"]) - {"migrate"}:
        assert SERVICES[name].get("healthcheck", {}).get("test"), name


@pytest.mark.parametrize("name", ["gateway", "gateway-vllm", "sim-prefill", "sim-decode", "prefill", "decode"])
def test_healthchecks_hit_the_port_the_service_listens_on(name):
    url = health_url(name)
    if name.startswith("sim-"):
        assert url == f"http://{sim_args(name).host}:{sim_args(name).port}/health"
    elif name in ("prefill", "decode"):
        assert url == f"http://localhost:{service_env(name)['PD_PORT']}/health"
    else:
        assert url.endswith(f":{gateway_settings(name).port}/ready")


# -- our image's commands ------------------------------------------------------------------------------
def test_dockerfile_builds_the_image_every_pd_service_uses():
    text = (ROOT / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["pd-gateway"]' in text
    for source in re.findall(r"^COPY (\S+)", text, re.M):
        assert (ROOT / source).exists(), source
    for name in ours():
        assert SERVICES[name]["build"]["context"] == "."


@pytest.mark.parametrize("name", ["gateway", "gateway-vllm", "sim-prefill", "sim-decode", "migrate"])
def test_commands_parse_with_the_real_parsers(name):
    command = SERVICES[name]["command"]
    assert command[0] in ("serve", "sim", "migrate")
    if command[0] == "serve":
        gateway_settings(name)                 # raises on an unknown flag, PDGW_* variable or a bad value
    elif command[0] == "sim":
        sim_args(name)
    else:
        assert cli.migrate_parser().parse_args(command[1:]).redis_url.startswith("redis://redis:")


@pytest.mark.parametrize("profile", ["sim", "vllm"])
def test_gateway_reaches_the_engines_and_store_of_its_own_profile(profile):
    settings = gateway_settings(GATEWAYS[profile])
    names = PROFILES[profile]
    for url in [*settings.prefill, *settings.decode, settings.redis_url]:
        host = re.match(r"\w+://([\w.-]+)", url).group(1)
        assert host in names, f"{url} is not a service of profile {profile}"
    for role, urls in (("prefill", settings.prefill), ("decode", settings.decode)):
        engine = f"sim-{role}" if profile == "sim" else role
        port = sim_args(engine).port if profile == "sim" else int(service_env(engine)["PD_PORT"])
        assert urls == [f"http://{engine}:{port}"]
    depends = SERVICES[GATEWAYS[profile]]["depends_on"]
    assert {d for d, c in depends.items() if c["condition"] == "service_healthy"} >= {
        re.match(r"http://([\w-]+)", u).group(1) for u in settings.prefill + settings.decode}


def test_simulated_engines_advertise_reachable_hosts_and_recommended_policies():
    for name, policy in (("sim-prefill", "fail"), ("sim-decode", "fail")):
        args = sim_args(name)
        assert args.host == SERVICES[name]["hostname"] == name     # handles carry it: the peer must resolve it
        assert args.kv_load_failure_policy == policy and args.stream_kv_params


def test_simulated_engines_run_coding_agents_as_the_demo_does():
    """Coding agents send tools with tool_choice auto (a 400 without a parser) and ask max_tokens 32000 on
    prompts of ~30k tokens (a 400 in a 32k context): the compose sim profile runs the demo's settings."""
    demo_args = sim_cli.parser().parse_args(["--role", "prefill", *demo.sim_flags("builtin:demo")])
    for args in (sim_args("sim-prefill"), sim_args("sim-decode"), demo_args):
        assert args.enable_auto_tool_choice and args.tool_call_parser == "hermes" and args.tool_call_rounds > 0
        assert args.max_model_len >= 32_000 + 64_000
        assert args.num_blocks * args.block_size >= 2 * args.max_model_len
    for name in ("sim-prefill", "sim-decode"):
        assert " ".join(demo.AGENT_READY) in " ".join(SERVICES[name]["command"])


def test_every_pdgw_variable_names_a_setting():
    env_files = {p for s in SERVICES.values() for p in s.get("env_file") or []}
    for path in env_files:
        config.from_env(read_env_file(ROOT / path))          # raises ConfigError on an unknown PDGW_*
    for name in SERVICES:
        config.from_env(service_env(name))


# -- vLLM engines ------------------------------------------------------------------------------------
@pytest.mark.parametrize(("name", "role", "policy"), [("prefill", "kv_producer", "fail"),
                                                      ("decode", "kv_consumer", "fail")])
def test_vllm_engines_get_the_protocol_flags(tmp_path, name, role, policy):
    argv = vllm_argv(name, tmp_path)
    env, gateway = service_env(name), gateway_settings("gateway-vllm")
    assert argv[:2] == ["serve", gateway.tokenizer]             # one model id for P, D and the gateway
    assert flag(argv, "--port") == env["PD_PORT"]
    kv = json.loads(flag(argv, "--kv-transfer-config"))
    assert kv["kv_connector"] == "NixlConnector" and kv["kv_role"] == role
    assert kv["kv_load_failure_policy"] == policy and kv["engine_id"] == env["PD_ENGINE_ID"]
    extra = kv["kv_connector_extra_config"]
    assert extra["bidirectional_kv_xfer"] is True
    assert extra["decoder_kv_blocks_ttl"] == gateway.decoder_kv_blocks_ttl_s
    assert gateway.handle_ttl_s < extra["decoder_kv_blocks_ttl"]
    assert extra["kv_lease_duration"] > 0
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == SERVICES[name]["hostname"] == name
    assert int(env["VLLM_NIXL_SIDE_CHANNEL_PORT"]) > 0


def test_vllm_pair_shares_image_model_cache_and_block_size_but_not_gpus(tmp_path):
    p, d = SERVICES["prefill"], SERVICES["decode"]
    assert p["image"] == d["image"] and p["build"] == d["build"]
    assert p["build"]["args"]["VLLM_IMAGE"].startswith("${VLLM_IMAGE:-vllm/vllm-openai:")
    assert flag(vllm_argv("prefill", tmp_path), "--block-size") == flag(vllm_argv("decode", tmp_path), "--block-size")
    cache = read_env_file(ROOT / "deploy/pd.env")["HF_HOME"]
    for name in ("prefill", "decode", "gateway-vllm"):
        assert any(v.split(":")[:2] == ["models", cache] for v in SERVICES[name]["volumes"]), name
    assert "models" in COMPOSE["volumes"]
    devices = [s["deploy"]["resources"]["reservations"]["devices"][0] for s in (p, d)]
    assert all(dev["driver"] == "nvidia" and dev["capabilities"] == ["gpu"] for dev in devices)
    assert interpolate(devices[0]["device_ids"], {}) != interpolate(devices[1]["device_ids"], {})


def test_vllm_engines_run_the_official_image_with_the_stream_plugin():
    """Issue 38: the profile ran the stock image, so every turn after a streamed one was handle_not_streamed."""
    build = SERVICES["decode"]["build"]
    dockerfile = (ROOT / build["context"] / build["dockerfile"]).read_text()
    steps = [line.split(None, 1) for line in dockerfile.splitlines() if line and not line.startswith("#")]
    assert ["FROM", "${VLLM_IMAGE}"] in steps and "ARG VLLM_IMAGE=vllm/vllm-openai:" in dockerfile
    copies = {tuple(rest.split()) for step, *rest in steps if step == "COPY" for rest in rest}
    for source, _ in copies:
        assert (ROOT / build["context"] / source).exists(), source
        assert not dockerignored(source), f"{source} is left out of the build context by .dockerignore"
    assert ("plugins/vllm-pdgw-stream", "/opt/pdgw/vllm-pdgw-stream") in copies
    assert "install --system --no-deps /opt/pdgw/vllm-pdgw-stream" in dockerfile
    plugin = _toml(ROOT / "plugins/vllm-pdgw-stream/pyproject.toml")
    assert "pdgw_stream" in plugin["project"]["entry-points"]["vllm.general_plugins"]
    assert "'pdgw_stream'" in dockerfile                        # the build fails if vLLM would not find it
    entry = SERVICES["decode"]["entrypoint"]
    assert ("deploy/vllm-serve.sh", entry[1]) in copies and f'ENTRYPOINT ["/bin/sh", "{entry[1]}"]' in dockerfile


def dockerignored(path: str) -> bool:
    """Docker's rule: the last .dockerignore pattern matching the path or a folder above it decides (`!`: kept)."""
    import fnmatch

    ignored = False
    parts = path.split("/")
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        pattern = line.strip()
        if not pattern or pattern.startswith("#"):
            continue
        keep, pattern = pattern.startswith("!"), pattern.lstrip("!")
        if any(fnmatch.fnmatch("/".join(parts[:i]), pattern) for i in range(1, len(parts) + 1)):
            ignored = not keep
    return ignored


def test_the_dockerignore_rule_as_docker_reads_it():
    assert dockerignored("deploy/prometheus.yml") and dockerignored("tests/unit/x.py")
    assert not dockerignored("deploy/vllm-serve.sh") and not dockerignored("plugins/vllm-pdgw-stream")


def _toml(path: Path) -> dict[str, Any]:
    import tomllib

    return tomllib.loads(path.read_text())


def test_the_vllm_gateway_streams_with_the_handle_the_plugin_hands_back():
    """With the plugin D's streamed answers carry the handle: `miss` streams and loses none; `buffer` is for
    engines without it (docs/vllm-stream-plugin.md), and costs streaming."""
    settings = gateway_settings("gateway-vllm")
    assert read_env_file(ROOT / "deploy/pd.env")["PDGW_STREAM_HANDLE_POLICY"] == settings.stream_handle_policy
    assert settings.stream_handle_policy == "miss" and "build" in SERVICES["decode"]


def test_the_engine_script_refuses_a_bad_role(tmp_path):
    env = {**service_env("prefill"), "PD_ROLE": "both", "PATH": os.environ["PATH"]}
    result = subprocess.run(["/bin/sh", str(ROOT / "deploy/vllm-serve.sh")], env=env, capture_output=True,
                            text=True, timeout=30)
    assert result.returncode == 2 and "PD_ROLE" in result.stderr


# -- observability -----------------------------------------------------------------------------------
def test_prometheus_scrapes_the_gateways_and_engines():
    scrape = yaml.safe_load((ROOT / "deploy/prometheus.yml").read_text())["scrape_configs"]
    targets = {t for job in scrape for group in job["static_configs"] for t in group["targets"]}
    expected = {f"{name}:{gateway_settings(name).port}" for name in GATEWAYS.values()}
    expected |= {f"{n}:{sim_args(n).port}" for n in ("sim-prefill", "sim-decode")}
    expected |= {f"{n}:{service_env(n)['PD_PORT']}" for n in ("prefill", "decode")}
    assert targets == expected
    mounts = SERVICES["prometheus"]["volumes"]
    assert "./deploy/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in mounts


def test_grafana_provisioning_points_at_the_dashboard():
    grafana = SERVICES["grafana"]
    mounts = dict(v.rsplit(":", 1)[0].split(":") for v in grafana["volumes"])
    provider = yaml.safe_load((ROOT / "deploy/grafana/provisioning/dashboards/pd-gateway.yaml").read_text())
    datasource = yaml.safe_load((ROOT / "deploy/grafana/provisioning/datasources/prometheus.yaml").read_text())
    assert mounts["./deploy/grafana/dashboards"] == provider["providers"][0]["options"]["path"]
    assert mounts["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning"
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == provider["providers"][0]["options"]["path"] + "/pd-gateway.json"
    assert datasource["datasources"][0]["url"] == "http://prometheus:9090"
    uids = {p["datasource"]["uid"] for d in DASHBOARDS.values() for p in d["panels"]}
    assert uids == {datasource["datasources"][0]["uid"]}
    assert len({d["uid"] for d in DASHBOARDS.values()}) == len(DASHBOARDS) == 2


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_dashboard_structure(name):
    DASHBOARD = DASHBOARDS[name]
    for key in ("uid", "title", "schemaVersion", "panels", "time", "templating", "annotations"):
        assert key in DASHBOARD, key
    panels = DASHBOARD["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    cells = set()
    for panel in panels:
        assert panel["type"] in ("stat", "timeseries", "table", "gauge", "bargauge")
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["w"] > 0 and grid["h"] > 0 and grid["x"] + grid["w"] <= 24
        cell = {(x, y) for x in range(grid["x"], grid["x"] + grid["w"])
                for y in range(grid["y"], grid["y"] + grid["h"])}
        assert not cells & cell, f"panel {panel['title']!r} overlaps another"
        cells |= cell
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(set(refs)) == len(refs)
        for target in panel["targets"]:
            assert target["expr"].count("(") == target["expr"].count(")")
            assert target["expr"].count("{") == target["expr"].count("}")


def test_dashboard_covers_the_questions_operators_ask():
    titles = " | ".join(p["title"] for p in DASHBOARD["panels"])
    for topic in ("Reuse rate", "Plans by reason", "Prompt tokens reused vs computed", "TTFT per leg",
                  "Engine health"):
        assert topic in titles


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_dashboard_queries_only_existing_metrics(name):
    DASHBOARD = DASHBOARDS[name]
    exported = set()
    for line in Metrics().render().decode().splitlines():
        if line.startswith("# TYPE "):
            name, kind = line.split()[2:4]            # counters already end in _total here
            exported |= {name} | ({f"{name}_bucket", f"{name}_sum", f"{name}_count"} if kind == "histogram" else set())
    used = {m for p in DASHBOARD["panels"] for t in p["targets"] for m in re.findall(r"\bpdgw_\w+", t["expr"])}
    assert used and used <= exported, used - exported
    phases = {m for p in DASHBOARD["panels"] for t in p["targets"] for m in re.findall(r'phase=~"([^"]+)"', t["expr"])}
    assert set("|".join(phases).split("|")) - {""} <= {"intake", "plan", "prefill", "decode_ttft", "total"}
    phases = {m for p in DASHBOARD["panels"] for t in p["targets"] for m in re.findall(r'phase="([^"]+)"', t["expr"])}
    assert phases <= {"intake", "plan", "prefill", "decode_ttft", "total"}


def test_the_data_plane_dashboard_shows_transfers_beside_the_gateways_timings():
    """Issue 28: TTFT, D's wait for remote KV, transfer p50/p90, bytes and descriptors per transfer, failed
    transfers, expired leases and pins, per engine and per P-D pair, in one place."""
    board = DASHBOARDS["pd-data-plane.json"]
    titles = " | ".join(p["title"] for p in board["panels"])
    for topic in ("TTFT", "D's wait for remote KV", "p50 / p90", "Bytes per transfer", "Descriptors per transfer",
                  "Failed transfers", "Expired leases", "Pins per D", "per P-D pair"):
        assert topic in titles, topic
    exprs = [t["expr"] for p in board["panels"] for t in p["targets"]]
    assert any("$prefill" in e and "$decode" in e for e in exprs)            # a pair's engines chosen together
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert set(variables) == {"prefill", "decode"}
    for name, variable in variables.items():
        assert f'pool="{name}"' in variable["query"]["query"] and variable["multi"] and variable["includeAll"]
    for expr in exprs:                                 # every engine series is per engine: grouped or filtered by it
        if "pdgw_engine_" in expr:
            assert re.search(r"by \([^)]*\bengine\b", expr) and 'engine=~"$' in expr, expr


def test_compose_mentions_no_setting_the_gateway_lacks():
    """A flag renamed in Settings must be renamed here too (shlex: commands as a person would type them)."""
    fields = {f.name for f in msgspec.structs.fields(config.Settings)}
    for name in GATEWAYS.values():
        for word in shlex.split(" ".join(SERVICES[name]["command"])):
            if word.startswith("--"):
                assert word[2:].replace("-", "_") in fields, word
