"""`pd-gateway` command: serve, demo, sim, migrate, check. Flags → Settings → action; no logic here."""

from __future__ import annotations

import argparse
import sys
import typing

import msgspec

from gateway import config
from gateway.config import Settings

HELP = {
    "prefill": "prefill engine base URL (repeatable)",
    "decode": "decode engine base URL (repeatable)",
    "redis_url": "Redis URL for shared conversation state; without it an embedded single-process store is used",
    "tokenizer": "tokenizer: builtin:demo, builtin:demo-reasoning, a local path or a hub id (must match the engines)",
    "chat_template": "chat template file overriding the tokenizer's",
    "model": "served model name (default: what the engines report)",
    "block_size": "KV block size (default: read from the engines' vllm:cache_config_info)",
    "session_header": "request header carrying the session id",
    "decoder_kv_blocks_ttl_s": "D's decoder_kv_blocks_ttl: how long D pins a finished turn's KV",
    "handle_ttl_margin_s": "stop using a D handle this long before D unpins it",
    "conversation_ttl_s": "forget a conversation this long after its last turn",
    "stream_handle_policy": "when D streams without its handle: miss (count it) or buffer (non-streamed D leg, re-streamed)",
    "history_tokens": "rendered (default) or generated",
    "decode_load_bound": "outstanding requests above which a conversation leaves its D",
    "pd_headers": "send X-PD-Plan / X-PD-Reason / X-PD-Reused-Tokens",
    "max_body_bytes": "largest accepted request body",
    "connect_timeout_s": "engine connect timeout",
    "prefill_timeout_s": "P leg deadline",
    "decode_first_byte_timeout_s": "D leg deadline for its first byte",
    "decode_idle_timeout_s": "D leg deadline between two streamed chunks",
    "health_interval_s": "engine health check period",
    "log_level": "debug, info, warning, error",
    "admin_key": "enables the admin API (/admin/*) for requests bearing this key",
    "host": "listen address",
    "port": "listen port (0: any free port)",
}


def settings_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, argument_default=None)
    parser.add_argument("--config", help="YAML or TOML settings file (flags > PDGW_* env > file > defaults)")
    parser.add_argument("--port-file", help="write the bound port here once listening (for supervisors and tests)")
    for field in msgspec.structs.fields(Settings):
        flag = "--" + field.name.replace("_", "-")
        help_text = f"{HELP.get(field.name, '')} (default: {field.default!r})"
        if field.type == list[str]:
            parser.add_argument(flag, action="extend", nargs="+", dest=field.name, help=help_text)
        elif field.type is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, dest=field.name, help=help_text)
        else:
            choices = typing.get_args(field.type) if typing.get_origin(field.type) is typing.Literal else None
            parser.add_argument(flag, dest=field.name, choices=choices, type=_scalar(field.type), help=help_text)
    return parser


def _scalar(annotation: object):
    kinds = [a for a in typing.get_args(annotation) or (annotation,) if a is not type(None)]
    return kinds[0] if len(kinds) == 1 and kinds[0] in (int, float) else str


def parse_settings(argv: list[str], prog: str) -> tuple[Settings, argparse.Namespace]:
    args = settings_parser(prog).parse_args(argv)
    flags = {k: v for k, v in vars(args).items() if k not in ("config", "port_file")}
    return config.build(flags, args.config), args


def serve(argv: list[str]) -> None:
    from gateway.app import create_app
    from gateway.serving import serve as run
    from gateway.telemetry import setup_logging

    settings, args = parse_settings(argv, "pd-gateway serve")
    setup_logging(settings.log_level)
    try:
        app = create_app(settings)
    except ValueError as exc:
        raise SystemExit(f"pd-gateway serve: {exc}") from None
    run(app, settings.host, settings.port, port_file=args.port_file, log_level=settings.log_level)


def migrate(argv: list[str]) -> None:
    import asyncio

    from gateway.store.migrate import apply_migrations

    parser = argparse.ArgumentParser(prog="pd-gateway migrate", description="apply migrations/ to the Redis store")
    parser.add_argument("--redis-url", default=config.from_env().get("redis_url"), required=False)
    args = parser.parse_args(argv)
    if not args.redis_url:
        raise SystemExit("pd-gateway migrate: --redis-url (or PDGW_REDIS_URL) is required")
    applied = asyncio.run(apply_migrations(args.redis_url))
    print(f"applied migrations: {applied or 'none (up to date)'}")


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    command, rest = (argv[0], argv[1:]) if argv else ("", [])
    if command == "sim":
        from gateway.sim.cli import main as sim_main

        sim_main(rest)
    elif command == "serve":
        serve(rest)
    elif command == "demo":
        from gateway.demo import main as demo_main

        demo_main(rest)
    elif command == "migrate":
        migrate(rest)
    else:
        raise SystemExit("usage: pd-gateway {serve,demo,sim,migrate} ... (pd-gateway COMMAND --help)")
