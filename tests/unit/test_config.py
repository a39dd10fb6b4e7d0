"""Settings from flags, PDGW_* environment and YAML/TOML files: precedence, validation, masking."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway import config
from gateway.config import ConfigError, Settings

ROOT = Path(__file__).resolve().parents[2]


def build(flags=None, file=None, env=None) -> Settings:
    return config.build(flags or {}, file, env or {})


@pytest.fixture
def yaml_file(tmp_path):
    path = tmp_path / "gateway.yaml"
    path.write_text("port: 7000\nprefill-timeout-s: 30\ndecode: [http://d0:8200, http://d1:8200]\n")
    return str(path)


@pytest.mark.parametrize(("flags", "env", "port"), [
    ({}, {}, 7000),                                          # file over defaults
    ({}, {"PDGW_PORT": "7100"}, 7100),                       # env over file
    ({"port": 7200}, {"PDGW_PORT": "7100"}, 7200),           # flag over env
])
def test_precedence_flags_over_env_over_file_over_defaults(yaml_file, flags, env, port):
    settings = build(flags, yaml_file, env)
    assert settings.port == port
    assert settings.prefill_timeout_s == 30.0                 # from the file, untouched by the others
    assert settings.decode_idle_timeout_s == 60.0             # default


def test_toml_file_and_pdgw_config_variable(tmp_path):
    path = tmp_path / "gateway.toml"
    path.write_text('prefill = ["http://p0:8100"]\nredis_url = "redis://redis:6379/0"\npd_headers = false\n')
    settings = build(env={"PDGW_CONFIG": str(path)})
    assert settings.prefill == ["http://p0:8100"] and settings.redis_url == "redis://redis:6379/0"
    assert settings.pd_headers is False


def test_env_lists_are_comma_separated_and_empty_means_unset():
    settings = build(env={"PDGW_PREFILL": "http://p0:1, http://p1:1", "PDGW_REDIS_URL": "",
                          "PDGW_PD_HEADERS": "false"})
    assert settings.prefill == ["http://p0:1", "http://p1:1"]
    assert settings.redis_url is None and settings.pd_headers is False


@pytest.mark.parametrize(("flags", "env", "words"), [
    ({"prefill_timeout_s": "-1"}, {}, ["prefill_timeout_s", "--prefill-timeout-s", "> 0"]),
    ({}, {"PDGW_DECODE_IDLE_TIMEOUT_S": "0"}, ["decode_idle_timeout_s", "PDGW_DECODE_IDLE_TIMEOUT_S"]),
    ({"port": "70000"}, {}, ["port", "65535"]),
    ({"prefill": ["p0:8100"]}, {}, ["prefill", "not a valid URL"]),
    ({"decode": ["http://d0:port"]}, {}, ["decode", "not a valid URL"]),
    ({"redis_url": "http://redis:6379"}, {}, ["redis_url", "redis or rediss or unix"]),
    ({"otlp_endpoint": "collector:4318"}, {}, ["otlp_endpoint"]),
    ({"handle_ttl_margin_s": "600"}, {}, ["handle_ttl_margin_s", "decoder_kv_blocks_ttl_s"]),
    ({"log_format": "xml"}, {}, ["log_format"]),
    ({"session_header": "X Session"}, {}, ["session_header"]),
    ({}, {"PDGW_DECODE_LOAD_BOUND": "many"}, ["decode_load_bound", "PDGW_DECODE_LOAD_BOUND"]),
])
def test_invalid_values_name_the_setting_and_its_source(flags, env, words):
    with pytest.raises(ConfigError) as caught:
        build(flags, env=env)
    for word in words:
        assert word in str(caught.value)


def test_a_bad_password_never_shows_in_the_error():
    with pytest.raises(ConfigError) as caught:
        build({"redis_url": "http://user:hunter2@redis:6379"})
    assert "hunter2" not in str(caught.value)


def test_unknown_file_key_is_refused_with_a_suggestion(tmp_path):
    path = tmp_path / "gateway.yaml"
    path.write_text("prefil_timeout_s: 3\n")
    with pytest.raises(ConfigError, match=r"unknown setting 'prefil_timeout_s' in .*did you mean 'prefill_timeout_s'"):
        build(file=str(path))


@pytest.mark.parametrize(("text", "match"), [("- a\n- b\n", "mapping"), ("port: [\n", "not valid YAML")])
def test_malformed_files_are_refused(tmp_path, text, match):
    path = tmp_path / "gateway.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=match):
        build(file=str(path))


def test_missing_file_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="config file"):
        build(file=str(tmp_path / "absent.yaml"))


def test_unknown_pdgw_variable_is_refused_with_a_suggestion():
    with pytest.raises(ConfigError, match=r"PDGW_REDIS_UR\b.*did you mean 'PDGW_REDIS_URL'"):
        build(env={"PDGW_REDIS_UR": "redis://r:6379"})


def test_effective_masks_secrets():
    settings = build({"admin_key": "s3cret", "redis_url": "redis://app:pa55@redis:6379/0"})
    shown = config.effective(settings)
    assert shown["admin_key"] == config.MASK
    assert shown["redis_url"] == "redis://app:***@redis:6379/0"
    assert "s3cret" not in str(shown) and "pa55" not in str(shown)
    assert set(shown) == set(config.FIELDS)


@pytest.mark.parametrize(("url", "masked"), [
    ("redis://redis:6379/0", "redis://redis:6379/0"),
    ("redis://:pw@redis:6379/0", "redis://:***@redis:6379/0"),
    ("rediss://user:pw@h/1", "rediss://user:***@h/1"),
])
def test_mask_url(url, masked):
    assert config.mask_url(url) == masked


def test_an_otlp_endpoint_turns_tracing_on():
    assert build().tracing == "off"
    assert build({"otlp_endpoint": "http://collector:4318/v1/traces"}).tracing == "otlp"
    assert build({"tracing": "console"}).tracing == "console"


@pytest.mark.parametrize("entry, ok", [
    ("http://d:8000=tcp://d:5557", True), ("http://d:8000/=ipc:///tmp/d.sock", True),
    ("http://d:8000=tcp://*:5557", True),                     # the engine's own host: vLLM's bind pasted as it is
    ("http://x:8000=tcp://d:5557", False), ("http://d:8000=d:5557", False), ("http://d:8000", False),
    ("http://d:8000=tcp://*:*", False),
    ("dns://pdgw-decode:8200=tcp://*:5557", True), ("dns://pdgw-decode:8200/=tcp://*:5557", True),
    ("dns://pdgw-decode:8200=tcp://10.0.0.1:5557", False),    # every engine found would read one engine's events
    ("dns://pdgw-decode:8200=ipc:///tmp/d.sock", False), ("dns://pdgw-other:8200=tcp://*:5557", False),
    ("dns://pdgw-decode:8300=tcp://*:5557", False)])
def test_kv_events_name_a_pool_entry_and_an_endpoint(entry, ok):
    flags = {"prefill": ["http://p:8000"], "decode": ["http://d:8000", "dns://pdgw-decode:8200"], "kv_events": [entry]}
    if ok:
        assert config.build(flags, environ={}).kv_events == [entry]
    else:
        with pytest.raises(ConfigError, match=r"^invalid setting kv_events \(from --kv-events\): '") as caught:
            config.build(flags, environ={})
        assert "\n" not in str(caught.value)


@pytest.mark.parametrize("entry, ok", [
    ("dns://pdgw-decode.ns.svc.cluster.local:8000", True), ("dns://pdgw-decode:8000/", True),
    ("dns://pdgw-decode", False), ("dns://pdgw-decode:8000/v1", False), ("dns://:8000", False),
    ("dns+https://pdgw-decode:8000", False)])
def test_a_dns_entry_is_a_name_and_the_engines_port(entry, ok):
    flags = {"prefill": ["http://p:8000"], "decode": [entry]}
    if ok:
        assert config.build(flags, environ={}).decode == [entry]
    else:
        with pytest.raises(ConfigError, match="decode"):
            config.build(flags, environ={})


@pytest.mark.parametrize("value, address", [
    ("10.96.0.10", ("10.96.0.10", 53)), ("127.0.0.1:5353", ("127.0.0.1", 5353)), ("[::1]:53", ("::1", 53)),
    ("kube-dns.kube-system", None), ("10.0.0.1:port", None)])
def test_the_discovery_nameserver_is_an_address(value, address):
    if address is not None:
        assert config.nameserver(config.build({"discovery_nameserver": value}, environ={}).discovery_nameserver) \
            == address
    else:
        with pytest.raises(ConfigError, match="discovery_nameserver"):
            config.build({"discovery_nameserver": value}, environ={})


# -- several models (issue 39) -------------------------------------------------------------------------------
MODELS = """
decoder_kv_blocks_ttl_s: 300
local_prefill_max_tokens: 512
models:
  - name: org/big
    aliases: [big]
    prefill: [http://p0:1]
    decode: [http://d0:1]
  - name: small
    prefill: [http://p1:1]
    decode: [http://d1:1]
    tokenizer: builtin:demo-reasoning
    local_prefill_max_tokens: 0
    kv_events: ["http://d1:1=tcp://d1:5557"]
"""


def test_each_model_gets_the_top_level_where_it_leaves_a_setting_out(tmp_path):
    path = tmp_path / "models.yaml"
    path.write_text(MODELS)
    big, small = config.build({}, str(path), {}).deployment()
    assert (big.settings.model, big.settings.prefill, big.aliases) == ("org/big", ["http://p0:1"], ("big",))
    assert (small.settings.tokenizer, small.settings.local_prefill_max_tokens) == ("builtin:demo-reasoning", 0)
    assert (big.settings.local_prefill_max_tokens, big.settings.decoder_kv_blocks_ttl_s) == (512, 300)
    assert small.settings.decoder_kv_blocks_ttl_s == 300 and small.settings.kv_events
    assert big.scope != small.scope and big.scope == config.model_scope("org/big")      # a model's, for good
    assert config.build({"prefill": ["http://p:1"], "decode": ["http://d:1"]}, None, {}).deployment()[0].scope is None


@pytest.mark.parametrize(("extra", "words"), [
    ("prefill: [http://p9:1]\n", "leave prefill"),
    ("", "given twice"),
])
def test_a_models_file_that_cannot_serve_is_refused(tmp_path, extra, words):
    text = extra + MODELS + ("  - name: big\n    prefill: [http://p2:1]\n    decode: [http://d2:1]\n" if not extra
                             else "")
    path = tmp_path / "models.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=words):
        config.build({}, str(path), {})


def test_a_model_s_kv_events_name_its_own_engines(tmp_path):
    path = tmp_path / "models.yaml"
    path.write_text(MODELS.replace("http://d1:1=tcp", "http://d0:1=tcp"))
    with pytest.raises(ConfigError, match="kv_events"):
        config.build({}, str(path), {})


def test_models_come_from_a_file_only():
    with pytest.raises(ConfigError, match="settings file"):
        config.build({}, None, {"PDGW_MODELS": "x"})


def test_the_example_deployment_file_is_valid():
    models = config.build({}, str(ROOT / "deploy" / "models.example.yaml"), {}).deployment()
    assert [m.settings.model for m in models] == ["Qwen/Qwen3-8B", "meta-llama/Llama-3.1-8B-Instruct"]


def test_the_committed_schema_is_the_settings_schema():
    """deploy/settings.schema.json is `pd-gateway serve --print-schema`: regenerate it when a setting changes."""
    assert (ROOT / "deploy" / "settings.schema.json").read_text() == config.schema()
