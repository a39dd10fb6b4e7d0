"""One settings object for the whole gateway, built from flags, environment (`PDGW_*`) or a YAML/TOML file.

Precedence: flags > environment > file > defaults. Nothing here imports other gateway modules.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any, Literal

import msgspec
import yaml

DEFAULT_PORT = 8000
DEFAULT_TOKENIZER = "builtin:demo"
DEFAULT_SESSION_HEADER = "X-Session-Id"
DEFAULT_DECODER_KV_BLOCKS_TTL_S = 480.0
DEFAULT_HANDLE_TTL_MARGIN_S = 30.0
DEFAULT_TENANT = "default"

StreamHandlePolicy = Literal["miss", "buffer"]
HistoryTokens = Literal["rendered", "generated"]


class Settings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    prefill: list[str] = []
    decode: list[str] = []
    host: str = "0.0.0.0"
    port: int = DEFAULT_PORT
    redis_url: str | None = None
    tokenizer: str = DEFAULT_TOKENIZER
    chat_template: str | None = None
    model: str | None = None                      # served name; None: ask the engines
    block_size: int | None = None                 # None: read vllm:cache_config_info from the engines
    session_header: str = DEFAULT_SESSION_HEADER
    decoder_kv_blocks_ttl_s: float = DEFAULT_DECODER_KV_BLOCKS_TTL_S
    handle_ttl_margin_s: float = DEFAULT_HANDLE_TTL_MARGIN_S
    conversation_ttl_s: float = 86400.0
    stream_handle_policy: StreamHandlePolicy = "miss"
    history_tokens: HistoryTokens = "rendered"
    decode_load_bound: int = 64                    # outstanding requests above which affinity yields
    pd_headers: bool = True                        # X-PD-Plan / X-PD-Reason / X-PD-Reused-Tokens
    max_body_bytes: int = 8 * 1024 * 1024
    connect_timeout_s: float = 2.0
    prefill_timeout_s: float = 120.0
    decode_first_byte_timeout_s: float = 120.0
    decode_idle_timeout_s: float = 60.0
    health_interval_s: float = 2.0
    log_level: str = "info"
    admin_key: str | None = None                   # enables /admin/*; sent as "Authorization: Bearer KEY"

    @property
    def handle_ttl_s(self) -> float:
        """How long a stored D handle stays usable: D unpins at its TTL; P refuses reads 5 s before it."""
        return max(0.0, self.decoder_kv_blocks_ttl_s - self.handle_ttl_margin_s)


def load_file(path: str | Path) -> dict[str, Any]:
    text = Path(path).read_text()
    data = tomllib.loads(text) if str(path).endswith(".toml") else yaml.safe_load(text)
    return {k.replace("-", "_"): v for k, v in (data or {}).items()}


def from_env(environ: dict[str, str] | None = None) -> dict[str, Any]:
    """PDGW_FOO_BAR=... → foo_bar; lists are comma-separated."""
    environ = os.environ if environ is None else environ
    fields = {f.name: f.type for f in msgspec.structs.fields(Settings)}
    out: dict[str, Any] = {}
    for key, value in environ.items():
        name = key[5:].lower() if key.startswith("PDGW_") else None
        if name in fields:
            out[name] = value.split(",") if fields[name] == list[str] else value
    return out


def build(flags: dict[str, Any], config_file: str | None = None, environ: dict[str, str] | None = None) -> Settings:
    merged: dict[str, Any] = {}
    if config_file:
        merged.update(load_file(config_file))
    merged.update(from_env(environ))
    merged.update({k: v for k, v in flags.items() if v is not None})
    try:
        return msgspec.convert(merged, Settings, strict=False)
    except msgspec.ValidationError as exc:
        raise SystemExit(f"invalid configuration: {exc}") from None
