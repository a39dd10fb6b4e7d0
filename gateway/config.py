"""One settings object for the whole gateway, built from flags, environment (`PDGW_*`) or a YAML/TOML file.

Precedence: flags > environment > file > defaults. The file is `--config FILE` (or `PDGW_CONFIG`). Invalid
configuration (a bad value, an unknown key or variable, a malformed URL) raises `ConfigError` naming the
setting and where its value came from. Nothing here imports other gateway modules but the leaf urls.py (the
URLs' checks).
"""

from __future__ import annotations

import difflib
import hashlib
import os
import re
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal, NamedTuple

import msgspec
import yaml

from gateway.urls import MASK, check_dns_entry, check_url, mask_url, nameserver

DEFAULT_PORT = 8000
DEFAULT_TOKENIZER = "builtin:demo"
DEFAULT_SESSION_HEADER = "X-Session-Id"
# Session ids that coding agents send of their own accord (docs/operations.md#agent-harness-session-ids): Dynamo's
# canonical header, Claude Code, Codex CLI (session_id; newer: session-id, thread-id), OpenCode (its own providers'
# header; for other providers it sends X-Session-Id, the default --session-header).
DEFAULT_AGENT_SESSION_HEADERS = ["X-Dynamo-Session-Id", "X-Claude-Code-Session-Id", "session_id", "session-id",
                                 "thread-id", "x-opencode-session"]
VLLM_DECODER_KV_BLOCKS_TTL_S = 480.0        # vLLM's decoder_kv_blocks_ttl default (nixl)
DEFAULT_HANDLE_TTL_MARGIN_S = 30.0
VLLM_KV_LEASE_S = 30.0                     # vLLM's kv_lease_duration default (nixl/base_scheduler.py:82-86)
READ_DECLINE_MARGIN_S = 5.0                # vLLM declines a read of a handle within this of its expiry
DEFAULT_DECODE_PIN_BUDGET = 0.5
# The holder D computes a warm turn's new suffix itself up to this many tokens (the local path, issue 24): the cap;
# within it D's headroom decides (turns/reuse/headroom.py, issue 36). 8192: vLLM's prefill chunk on an H200 server.
DEFAULT_LOCAL_PREFILL_MAX_TOKENS = 8192
# What local prefills in flight may add to a step of D's running streams (bench/GPU-RESULTS.md, under load: PD's
# ITL p99 was 35-52 ms where one engine's was 37-122 ms; 20 ms keeps PD's p99 under 0.6x the co-located one's).
DEFAULT_LOCAL_ITL_BUDGET_MS = 20.0
# dns:// pool entries (engines/discovery.py) are resolved again this often: CoreDNS's answers for a Service live 5 s
DEFAULT_DISCOVERY_INTERVAL_S = 5.0
DEFAULT_TENANT = "default"
ENV_PREFIX = "PDGW_"
CONFIG_ENV = "PDGW_CONFIG"       # names the settings file when --config is not given

StreamHandlePolicy = Literal["miss", "buffer"]
HistoryTokens = Literal["rendered", "generated"]
ReusePolicy = Literal["cost", "always"]
LogLevel = Literal["debug", "info", "warning", "error", "critical"]
LogFormat = Literal["text", "json"]
TracingMode = Literal["off", "console", "otlp"]
ConversationLookup = Literal["session", "prefix", "both"]   # how a turn finds its conversation
SessionScope = Literal["head", "exact"]   # a session id scoped by the conversation's head (api/sessions.py), or not
PinPolicy = Literal["adaptive", "lru"]   # the pin budget: earned and D's pressure (earning.py), or fixed with LRU
KVTransferMode = Literal["auto", "pull", "push"]   # NixlConnector or NixlPushConnector (docs/protocol.md §8)

Seconds = Annotated[float, msgspec.Meta(gt=0)]            # a deadline or period: zero would never wait
NonNegativeSeconds = Annotated[float, msgspec.Meta(ge=0)]
Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]
PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
Fraction = Annotated[float, msgspec.Meta(ge=0, le=1)]


class ConfigError(ValueError):
    """Invalid configuration; the message names the setting."""


class ModelSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One model of a settings file's `models` (issue 39): the name requests give (`model`, or an alias), its own P
    and D engines, tokenizer and chat template, and the settings that are per model; those left out are the
    file's (or the flags') top-level ones."""
    name: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    aliases: list[str] = []
    prefill: list[str]
    decode: list[str]
    engine_names: list[str] | None = None
    kv_events: list[str] | None = None
    tokenizer: str | None = None
    chat_template: str | None = None
    block_size: PositiveInt | None = None
    decoder_kv_blocks_ttl_s: NonNegativeSeconds | None = None
    decode_kv_lease_s: NonNegativeSeconds | None = None
    decode_pin_budget: Fraction | None = None
    reuse_policy: ReusePolicy | None = None
    kv_transfer_mode: KVTransferMode | None = None
    local_prefill_max_tokens: Annotated[int, msgspec.Meta(ge=0)] | None = None
    local_itl_budget_ms: Annotated[float, msgspec.Meta(ge=0)] | None = None
    local_first_turns: bool | None = None


class ModelSetup(NamedTuple):
    """One model as the gateway serves it: its settings (the top level with the model's own), its aliases, and
    the scope its conversations are kept in (None: the tenant's own, as with one model)."""
    settings: Settings
    aliases: tuple[str, ...] = ()
    scope: str | None = None


class Settings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    prefill: list[str] = []
    decode: list[str] = []
    engine_names: list[str] = []                  # "NAME=URL": an engine's label in /metrics (default: role-index)
    host: str = "0.0.0.0"
    port: Port = DEFAULT_PORT
    metrics_port: Annotated[int, msgspec.Meta(ge=1, le=65535)] | None = None  # /metrics, /openapi.json on their own
    workers: PositiveInt = 1                      # processes serving the port (gateway/workers.py)
    redis_url: str | None = None
    tokenizer: str = DEFAULT_TOKENIZER
    chat_template: str | None = None
    model: str | None = None                      # served name; None: ask the engines
    block_size: PositiveInt | None = None         # None: read vllm:cache_config_info from the engines
    session_header: str = DEFAULT_SESSION_HEADER
    agent_session_headers: list[str] = msgspec.field(default_factory=lambda: list(DEFAULT_AGENT_SESSION_HEADERS))
    conversation_lookup: ConversationLookup = "both"  # session id, token prefix (no session id), or both
    session_scope: SessionScope = "head"          # a session id names one conversation per system prompt + tools
    decoder_kv_blocks_ttl_s: NonNegativeSeconds = VLLM_DECODER_KV_BLOCKS_TTL_S
    decode_kv_lease_s: NonNegativeSeconds = VLLM_KV_LEASE_S  # D's kv_lease_duration (local-turn handles)
    handle_ttl_margin_s: NonNegativeSeconds = DEFAULT_HANDLE_TTL_MARGIN_S
    conversation_ttl_s: Seconds = 86400.0
    decode_pin_budget: Fraction = DEFAULT_DECODE_PIN_BUDGET  # of D's KV blocks its stored handles may pin; 0: off
    decode_pin_policy: PinPolicy = "adaptive"     # "adaptive": pins that pay, up to the budget; "lru": the budget fixed
    stream_handle_policy: StreamHandlePolicy = "miss"
    history_tokens: HistoryTokens = "generated"    # keeps D's KV when answers re-tokenize otherwise (vllm-findings)
    decode_load_bound: PositiveInt = 64            # outstanding requests above which affinity yields
    reuse_policy: ReusePolicy = "cost"             # "cost": send D's handle only where reading beats recomputing
    kv_transfer_mode: KVTransferMode = "auto"      # "auto": what the engines' /server_info shows
    kv_events: list[str] = []     # "ENGINE_URL=tcp://HOST:PORT", "dns://NAME:PORT=tcp://*:PORT": KV events (ZMQ)
    local_prefill_max_tokens: Annotated[int, msgspec.Meta(ge=0)] = DEFAULT_LOCAL_PREFILL_MAX_TOKENS  # 0: off
    local_itl_budget_ms: Annotated[float, msgspec.Meta(ge=0)] = DEFAULT_LOCAL_ITL_BUDGET_MS
    local_first_turns: bool = False                # a turn with nothing to reuse: D alone within the local bound
    decode_handover_limit: Annotated[int, msgspec.Meta(ge=0)] = 0   # P-path D legs reading P's KV per D; 0: any
    rate_probe_tokens: Annotated[int, msgspec.Meta(ge=0)] = 8192  # the cost plan's calibration read; 0: no probes
    rate_probe_interval_s: Seconds = 300.0         # ... repeated this often per P-D pair
    prefill_affinity: bool = True                  # prefer the P that prefilled the conversation's last turn
    prefill_affinity_slack_tokens: int = 2048      # ... while within this many queued prompt tokens of the least loaded
    pd_headers: bool = True                        # X-PD-Plan / X-PD-Reason / X-PD-Reused-Tokens
    max_body_bytes: PositiveInt = 8 * 1024 * 1024
    header_timeout_s: Seconds = 10.0               # slow clients (gateway/connections.py): headers after 1st byte
    body_timeout_s: Seconds = 30.0                 # ... the whole body after the headers
    keep_alive_timeout_s: Seconds = 75.0           # an idle keep-alive connection
    max_connections: PositiveInt | None = None     # None: the open-file limit less what engines and store need
    connect_timeout_s: Seconds = 2.0
    prefill_timeout_s: Seconds = 120.0
    prefill_handle_timeout_s: Seconds = 15.0       # a P leg reading D's KV: then redone without the handle
    decode_first_byte_timeout_s: Seconds = 120.0
    decode_idle_timeout_s: Seconds = 60.0
    health_interval_s: Seconds = 2.0
    discovery_interval_s: Seconds = DEFAULT_DISCOVERY_INTERVAL_S   # dns:// pool entries resolved again this often
    discovery_nameserver: str | None = None        # "HOST[:PORT]" resolving them; None: the system's resolv.conf
    log_level: LogLevel = "info"
    log_format: LogFormat = "text"
    tracing: TracingMode = "off"
    otlp_endpoint: str | None = None               # setting it turns tracing on ("otlp")
    admin_key: str | None = None                   # enables /admin/*; sent as "Authorization: Bearer KEY"
    api_keys: list[str] = []                       # "TENANT:SHA256-HEX-OF-KEY"; none: open, one default tenant
    api_keys_file: str | None = None               # one "TENANT SHA256-HEX" per line
    max_retries: Annotated[int, msgspec.Meta(ge=0)] = 2   # extra legs a turn may spend on engine failures
    max_concurrent_turns: PositiveInt = 1024
    max_queued_prompt_tokens: PositiveInt = 4_000_000     # prompt tokens admitted but not yet prefilled
    max_messages: PositiveInt = 4096
    models: list[ModelSettings] = []               # several models, each with its engines (settings file only)

    def __post_init__(self) -> None:
        self._check_models()
        for name in ("prefill", "decode"):
            for url in getattr(self, name):
                check_url(name, url, ("http", "https", "dns"))
                if url.startswith("dns:"):
                    check_dns_entry(name, url)
        if self.discovery_nameserver is not None:
            nameserver(self.discovery_nameserver)
        if self.metrics_port is not None and self.metrics_port == self.port:
            raise ValueError("metrics_port: must differ from port (the metrics listener is a second socket)")
        if self.workers > 1 and self.redis_url is None:
            raise ValueError("workers: more than one needs redis_url (the embedded store lives in one process, "
                             "and each worker would see only its own conversations)")
        for entry in self.engine_names:
            if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}=\S+", entry):
                raise ValueError(f"engine_names: {entry!r} is not NAME=URL (NAME: letters, digits, _ . -)")
        for entry in self.kv_events:      # KEY=ENDPOINT, KEY a pool entry; engines/kv_feeds.py reads them
            key, _, endpoint = entry.partition("=")
            if key.rstrip("/") not in {u.rstrip("/") for u in self.prefill + self.decode}:
                raise ValueError(f"kv_events: {entry!r} does not name a --prefill or --decode entry (URL or dns://)")
            if not re.fullmatch(r"tcp://\*:\d+" if key.startswith("dns:") else r"tcp://(\*|[^\s/*]+):\d+|ipc://\S+",
                                endpoint):
                raise ValueError(f"kv_events: {entry!r}: the endpoint must be tcp://*:PORT (the engine's own host; "
                                 "for a dns:// entry the only form), tcp://HOST:PORT or ipc://PATH")
        if self.redis_url is not None:
            check_url("redis_url", self.redis_url, ("redis", "rediss", "unix", "redis+sentinel", "redis+cluster"))
        if self.otlp_endpoint is not None:
            check_url("otlp_endpoint", self.otlp_endpoint, ("http", "https"))
            if self.tracing == "off":
                self.tracing = "otlp"
        if self.decoder_kv_blocks_ttl_s and self.handle_ttl_margin_s >= self.decoder_kv_blocks_ttl_s:
            raise ValueError("handle_ttl_margin_s: must be smaller than decoder_kv_blocks_ttl_s, "
                             "or no stored handle would ever be usable")
        if not re.fullmatch(r"[A-Za-z0-9-]+", self.session_header):
            raise ValueError(f"session_header: {self.session_header!r} is not an HTTP header name")
        for name in self.agent_session_headers:
            if not re.fullmatch(r"[A-Za-z0-9_-]+", name):
                raise ValueError(f"agent_session_headers: {name!r} is not an HTTP header name")

    def deployment(self) -> list[ModelSetup]:
        """The models served: the `models` of the file, else one, the top-level settings (the flags' shorthand).
        With several, each model's conversations are kept in a scope of their own (a session id used with two
        models is two conversations)."""
        if not self.models:
            return [ModelSetup(self)]
        return [ModelSetup(msgspec.structs.replace(self, models=[], model=m.name, **_own(m)), tuple(m.aliases),
                           model_scope(m.name)) for m in self.models]

    def _check_models(self) -> None:
        if self.models and (self.prefill or self.decode or self.model):
            raise ValueError("models: given, the engines and the served name are each model's: leave prefill, "
                             "decode and model out of the top level")
        names = [n for m in self.models for n in (m.name, *m.aliases)]
        if len(set(names)) < len(names):
            raise ValueError(f"models: a name or alias is given twice in {names}")
        for m in self.models:
            if not m.prefill or not m.decode:
                raise ValueError(f"models: {m.name!r} needs at least one prefill and one decode engine")
        self.deployment()           # each model's own settings, checked as the top level's are

    @property
    def handle_ttl_s(self) -> float:
        """How long a stored D handle stays usable: D unpins at its TTL; P refuses reads 5 s before it."""
        return max(0.0, self.decoder_kv_blocks_ttl_s - self.handle_ttl_margin_s)

    @property
    def lease_ttl_s(self) -> float:
        """How long a handle D returned for a local turn stays usable: D frees it `decode_kv_lease_s` after its
        answer, and, the handle having no expiry, P never declines a late read of it, so the margin covers the
        longest a P leg with a handle may wait before it reads (`prefill_handle_timeout_s`) and vLLM's own."""
        return max(0.0, self.decode_kv_lease_s - self.prefill_handle_timeout_s - READ_DECLINE_MARGIN_S)


def _own(model: ModelSettings) -> dict[str, Any]:
    return {k: v for k, v in msgspec.structs.asdict(model).items() if v is not None and k not in ("name", "aliases")}


def model_label(name: str) -> str:
    """A model's name as its engines' default metric names begin where several models are served."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)[:48]


def model_scope(name: str) -> str:
    """A model's conversation scope: a tenant's conversations with it are kept as `TENANT.SCOPE` (store/base.py
    allows the 9 more characters), the same for the model's whole life, whatever else is deployed."""
    return "m" + hashlib.blake2b(name.encode(), digest_size=4).hexdigest()


def engine_names(settings: Settings) -> dict[str, str]:
    """URL → the name it is shown by in metrics (`--engine-names NAME=URL`)."""
    return {url.rstrip("/"): name for name, _, url in (e.partition("=") for e in settings.engine_names)}


FIELDS: dict[str, Any] = {f.name: f.type for f in msgspec.structs.fields(Settings)}
SECRETS = ("admin_key", "api_keys")
FILE_ONLY = ("models",)          # settings a flag or a variable cannot hold
URL_FIELDS = ("prefill", "decode", "redis_url", "otlp_endpoint")


def schema() -> str:
    """The settings file's JSON Schema (every setting, `models` included): editors and CI check files with it."""
    return msgspec.json.format(msgspec.json.encode(msgspec.json.schema(Settings)), indent=2).decode() + "\n"


def effective(settings: Settings) -> dict[str, Any]:
    """The settings as `--print-config` shows them: every field, secrets masked."""
    out = msgspec.to_builtins(settings)
    for name in SECRETS:
        if out.get(name):
            out[name] = MASK
    for name in URL_FIELDS:
        value = out.get(name)
        if isinstance(value, list):
            out[name] = [mask_url(v) for v in value]
        elif value:
            out[name] = mask_url(value)
    return out


# -- sources -----------------------------------------------------------------------------------------
def load_file(path: str | Path) -> dict[str, Any]:
    try:
        text = Path(path).read_text()
        data = tomllib.loads(text) if str(path).endswith(".toml") else yaml.safe_load(text)
    except OSError as exc:
        raise ConfigError(f"config file {path}: {exc.strerror}") from None
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"config file {path} is not valid {'TOML' if str(path).endswith('.toml') else 'YAML'}: "
                          f"{exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of setting: value")
    out = {str(k).replace("-", "_"): v for k, v in data.items()}
    for key in out:
        if key not in FIELDS:
            raise ConfigError(f"unknown setting {key!r} in {path}{_suggest(key)}")
    return out


def from_env(environ: dict[str, str] | None = None) -> dict[str, Any]:
    """PDGW_FOO_BAR=... → foo_bar; lists are comma-separated; an empty value counts as unset."""
    environ = os.environ if environ is None else environ
    out: dict[str, Any] = {}
    for key, value in environ.items():
        if not key.startswith(ENV_PREFIX) or key == CONFIG_ENV:
            continue
        name = key[len(ENV_PREFIX):].lower()
        if name not in FIELDS:
            raise ConfigError(f"unknown environment variable {key}{_suggest(name, env=True)}")
        if name in FILE_ONLY:
            raise ConfigError(f"{key}: {name} is given in a settings file (--config) only")
        if value != "":
            out[name] = [v.strip() for v in value.split(",") if v.strip()] if FIELDS[name] == list[str] else value
    return out


def _suggest(name: str, env: bool = False) -> str:
    close = difflib.get_close_matches(name, FIELDS, n=1)
    if not close:
        return ""
    return f" (did you mean {ENV_PREFIX + close[0].upper() if env else close[0]!r}?)"


def build(flags: dict[str, Any], config_file: str | None = None, environ: dict[str, str] | None = None) -> Settings:
    """Merge the sources (flags > env > file > defaults) and validate; ConfigError names the bad setting."""
    environ = os.environ if environ is None else environ
    config_file = config_file or environ.get(CONFIG_ENV) or None
    layers = [(load_file(config_file) if config_file else {}, f"file {config_file}"),
              (from_env(environ), "env"), ({k: v for k, v in flags.items() if v is not None}, "flag")]
    merged: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for values, where in layers:
        merged.update(values)
        origin.update(dict.fromkeys(values, where))
    try:
        return msgspec.convert(merged, Settings, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(_explain(str(exc), origin)) from None


def _explain(message: str, origin: dict[str, str]) -> str:
    """msgspec says `... - at `$.port``; say which setting, and which flag, variable or file set it."""
    match = re.search(r" - at `\$\.(\w+)[^`]*`$", message)
    name = match.group(1) if match else next((n for n in FIELDS if message.startswith(n + ":")), None)
    if name is None:
        return f"invalid configuration: {message}"
    text = message[:match.start()] if match else message.removeprefix(name + ":").strip()
    where = {"flag": f"--{name.replace('_', '-')}", "env": ENV_PREFIX + name.upper()}.get(
        origin.get(name, ""), origin.get(name, "default"))
    return f"invalid setting {name} (from {where}): {text}"
