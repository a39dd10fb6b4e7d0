"""`pd-gateway` command: serve, demo, sim, migrate, check, verify. Flags → Settings → action; no logic here."""

from __future__ import annotations

import argparse
import asyncio
import errno
import sys
import typing
from typing import Any

import msgspec
import yaml

from gateway import config
from gateway.config import Settings

HELP = {
    "prefill": "prefill engine base URL, or dns://NAME:PORT to follow the engines a DNS name resolves to (repeatable)",
    "decode": "decode engine base URL, or dns://NAME:PORT to follow the engines a DNS name resolves to (repeatable)",
    "workers": "processes serving the port, each with its own event loop (more than one needs --redis-url)",
    "redis_url": "Redis URL for shared conversation state; without it an embedded single-process store is used",
    "tokenizer": "tokenizer: builtin:demo, builtin:demo-reasoning, a local path or a hub id (must match the engines)",
    "chat_template": "chat template file overriding the tokenizer's",
    "model": "served model name (default: what the engines report)",
    "block_size": "KV block size (default: read from the engines' vllm:cache_config_info)",
    "session_header": "request header carrying the session id",
    "agent_session_headers": "headers coding agents send their session id in, tried in order after --session-header (each names one conversation per system prompt); none: off",
    "session_scope": "head: a session id names one conversation per head (system prompt and tools), so a title or subagent request on the main loop's id keeps the main loop's reuse; exact: --session-header and body ids as given (harness headers are always scoped)",
    "conversation_lookup": "how a turn finds its conversation: session (id only), prefix (tokens only) or both",
    "decoder_kv_blocks_ttl_s": "D's decoder_kv_blocks_ttl: how long D pins a finished turn's KV",
    "decode_kv_lease_s": "D's kv_lease_duration: how long D holds a local turn's KV (must equal D's setting)",
    "handle_ttl_margin_s": "stop using a D handle this long before D unpins it",
    "kv_events": "ENGINE_URL=tcp://HOST:PORT (repeatable): subscribe to that engine's KV events (vLLM --kv-events-config) to know what its prefix cache holds; HOST * is the engine's own host; dns://NAME:PORT=tcp://*:PORT covers every engine that pool entry finds",
    "local_prefill_max_tokens": "the local path's cap: a warm turn goes to the holder D alone when D computes at most this many tokens and D's headroom allows (0: off)",
    "local_first_turns": "a turn with nothing to reuse (a first turn, no session) goes to D alone when its whole prompt is within the local bound, as a co-located engine serves it: no P leg, no KV hand-over",
    "decode_handover_limit": "at most this many D legs of the P path per D waiting for their first token (D reading P's KV), the rest sent in arrival order; 0: no limit",
    "local_itl_budget_ms": "what local prefills in flight on a D may add to a step of its running streams (with the learned prefill rate, the local bound while D decodes)",
    "conversation_ttl_s": "forget a conversation this long after its last turn",
    "decode_pin_budget": "fraction of each D's KV blocks the stored handles may pin; over it the least recently used idle ones are released (0: off, TTL only)",
    "decode_pin_policy": "adaptive: pin as much of the budget as pins pay (used before evicted or expired; less while D is short of blocks; kept by expected saving), or lru: the whole budget, least recently used released first",
    "stream_handle_policy": "when D streams without its handle: miss (count it) or buffer (non-streamed D leg, re-streamed)",
    "history_tokens": "generated (default: past answers as D's own ids) or rendered (as their text, re-encoded)",
    "decode_load_bound": "outstanding requests above which a conversation leaves its D",
    "reuse_policy": "cost: send D's handle only where P reading it beats recomputing (learned rates); always",
    "kv_transfer_mode": "auto (what the engines' /server_info shows), pull (NixlConnector: D reads P's KV after P) or push (NixlPushConnector: P writes into D's blocks, both legs sent at once)",
    "rate_probe_tokens": "under reuse_policy cost: tokens of the calibration read per P-D pair at start-up and after (0: none, rates learned from turns only)",
    "rate_probe_interval_s": "how often each P-D pair's calibration read is repeated",
    "prefill_affinity": "prefer the P that prefilled the conversation's last turn (its prefix cache holds that prompt)",
    "prefill_affinity_slack_tokens": "keep that P while its queued prompt tokens exceed the least loaded P's by at most this",
    "pd_headers": "send X-PD-Plan / X-PD-Reason / X-PD-Reused-Tokens",
    "max_body_bytes": "largest accepted request body",
    "connect_timeout_s": "engine connect timeout",
    "prefill_timeout_s": "P leg deadline",
    "prefill_handle_timeout_s": "deadline of a P leg that reads D's KV; then P is redone without the handle",
    "decode_first_byte_timeout_s": "D leg deadline for its first byte",
    "decode_idle_timeout_s": "D leg deadline between two streamed chunks",
    "health_interval_s": "engine health check period",
    "discovery_interval_s": "how often dns:// pool entries are resolved again (engines joining and leaving)",
    "discovery_nameserver": "IP[:PORT] of the nameserver resolving dns:// pool entries (default: resolv.conf's)",
    "log_level": "debug, info, warning, error or critical",
    "log_format": "text, or json: one JSON object per line (one line per turn at info level)",
    "tracing": "OpenTelemetry spans per turn and leg: off, console (stderr) or otlp",
    "otlp_endpoint": "OTLP/HTTP traces endpoint, e.g. http://collector:4318/v1/traces (turns tracing on: otlp)",
    "admin_key": "enables the admin API (/admin/*) for requests bearing this key",
    "api_keys": "client API keys as TENANT:SHA256-HEX (repeatable); none: no authentication, one tenant",
    "api_keys_file": "file of client API keys, one 'TENANT SHA256-HEX' per line",
    "max_retries": "extra legs a turn may spend on engine failures before the first byte",
    "max_concurrent_turns": "turns in flight above which new turns get 429",
    "max_queued_prompt_tokens": "prompt tokens admitted but not yet prefilled above which new turns get 429",
    "max_messages": "most messages a chat request may carry",
    "host": "listen address",
    "port": "listen port (0: any free port)",
    "metrics_port": "serve /metrics and /openapi.json on this port of --host (open there, and only they and "
                    "/health, /ready), not on --port; bind it where only Prometheus reaches",
    "engine_names": "an engine's name in /metrics labels, as NAME=URL (repeatable); default: role and order "
                    "(prefill-0, decode-1): labels never carry hosts or ports; an engine a dns:// entry found: "
                    "role and pod address (decode-10.0.3.7)",
    "header_timeout_s": "a client must send a request's headers within this of its first byte (or of connecting); "
                        "then 408 and the connection is closed",
    "body_timeout_s": "... and its whole body within this of its headers (a total); then 408 and closed",
    "keep_alive_timeout_s": "an idle keep-alive connection is closed after this (longer than load balancers' idle "
                            "timeouts, so the gateway is not the side closing as a request is written)",
    "max_connections": "open client connections per replica above which new ones get 503 and are closed "
                       "(default: the open-file limit less 256)",
}


NOT_SETTINGS = ("config", "port_file", "print_config", "print_schema", "json", "strict")

COMMANDS = {
    "serve": "run the gateway in front of vLLM prefill (--prefill) and decode (--decode) engines",
    "check": "probe the engines and the store, print the start-up report and a verdict (exit 1 on fail)",
    "verify": "rollout gate: a seeded suite through the gateway vs a co-located baseline, plus wrong-KV controls "
              "at P and D (exit 1 on any finding)",
    "demo": "gateway + simulated P and D + embedded store on this machine, with a scripted chat",
    "sim": "one simulated vLLM engine (prefill, decode or colocated)",
    "migrate": "apply migrations/ to the Redis store (idempotent)",
    "hash-key": "read an API key on stdin, print its SHA-256 for --api-keys",
}
# The errors that mean "nothing can listen there": say so in one line instead of a traceback.
_LISTEN_ERRORS = {errno.EADDRINUSE: "is already in use", errno.EACCES: "needs privileges",
                  errno.EADDRNOTAVAIL: "is not an address of this machine"}


def settings_parser(prog: str, description: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=description, argument_default=None)
    parser.add_argument("--config", help="YAML or TOML settings file, also PDGW_CONFIG "
                                         "(precedence: flags > PDGW_* env > file > defaults)")
    parser.add_argument("--port-file", help="write the bound port here once listening (for supervisors and tests)")
    for field in msgspec.structs.fields(Settings):
        if field.name in config.FILE_ONLY:
            continue
        flag = "--" + field.name.replace("_", "-")
        kind = _plain(field.type)
        env = config.ENV_PREFIX + field.name.upper()
        default = field.default_factory() if field.default is msgspec.NODEFAULT else field.default
        help_text = f"{HELP.get(field.name, '')} (default: {default!r}; env {env})"
        if kind == list[str]:
            parser.add_argument(flag, action="extend", nargs="+", dest=field.name, help=help_text)
        elif kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, dest=field.name, help=help_text)
        else:
            choices = typing.get_args(kind) if typing.get_origin(kind) is typing.Literal else None
            parser.add_argument(flag, dest=field.name, choices=choices, type=_scalar(kind), help=help_text)
    return parser


def _plain(annotation: object) -> object:
    """`Annotated[float, Meta(gt=0)]` → float (the constraint is checked by config.build, naming the setting)."""
    return typing.get_args(annotation)[0] if typing.get_origin(annotation) is typing.Annotated else annotation


def _scalar(annotation: object):
    kinds = [_plain(a) for a in typing.get_args(annotation) or (annotation,) if a is not type(None)]
    return kinds[0] if len(kinds) == 1 and kinds[0] in (int, float) else str


def parse_settings(argv: list[str], prog: str,
                   parser: argparse.ArgumentParser | None = None) -> tuple[Settings, argparse.Namespace]:
    args = (parser or settings_parser(prog)).parse_args(argv)
    flags = {k: v for k, v in vars(args).items() if k not in NOT_SETTINGS}
    try:
        return config.build(flags, args.config), args
    except config.ConfigError as exc:
        raise SystemExit(f"{prog}: {exc}") from None


def serve(argv: list[str]) -> None:
    from gateway.serving import write_port
    from gateway.telemetry import setup_logging

    parser = _serve_parser()
    if "--print-schema" in argv:            # before the settings are read: a file being written need not be valid
        print(config.schema(), end="")
        return
    settings, args = parse_settings(argv, "pd-gateway serve", parser)
    if args.print_config:
        print(yaml.safe_dump(config.effective(settings), sort_keys=False), end="")
        return
    setup_logging(settings.log_level, settings.log_format)
    app = _app(argv, settings, parser)          # with workers, each builds its own: this one checks the settings
    from gateway.startup import transfer_preflight
    for setup in settings.deployment():         # each model's pools: a mixed one is one line, not a start
        if refusal := asyncio.run(transfer_preflight(setup.settings)).refusal:
            raise SystemExit(f"pd-gateway serve: refused: {refusal}")
    started = write_port(args.port_file) if args.port_file else None
    try:
        if settings.workers > 1:
            from gateway import workers
            workers.run(serve_worker, argv, settings.workers, settings.host,
                        workers.Ports(settings.port, settings.metrics_port), started)
        else:
            _run(app, settings, settings.port, settings.metrics_port, started)
    except OSError as exc:
        if exc.errno not in _LISTEN_ERRORS:
            raise
        raise SystemExit(f"pd-gateway serve: {settings.host}:{settings.port} {_LISTEN_ERRORS[exc.errno]}: stop "
                         "what listens there (another gateway or scripts/demo?) or pass another --port") from None


def serve_worker(argv: list[str], ports: Any, ready: Any) -> None:
    """One of `serve --workers N`'s processes (gateway/workers.py, which passes its `Ports` and the `Connection`
    it waits on): the same flags, the ports the supervisor holds, bound with SO_REUSEPORT."""
    from gateway.telemetry import setup_logging

    parser = _serve_parser()
    settings, _ = parse_settings(argv, "pd-gateway serve", parser)
    setup_logging(settings.log_level, settings.log_format)

    def announce(port: int) -> None:
        try:
            ready.send(port)
        except OSError:             # a replacement worker: the supervisor no longer waits for it
            pass

    _run(_app(argv, settings, parser), settings, ports.api, ports.metrics, announce, reuse_port=True)


def _serve_parser() -> argparse.ArgumentParser:
    parser = settings_parser("pd-gateway serve", "Run the gateway.")
    parser.add_argument("--print-config", action="store_true",
                        help="print the effective settings (secrets masked) as YAML and exit")
    parser.add_argument("--print-schema", action="store_true",
                        help="print the settings file's JSON Schema (deploy/settings.schema.json) and exit")
    return parser


def _app(argv: list[str], settings: Settings, parser: argparse.ArgumentParser) -> Any:
    from gateway.app import create_app
    try:
        # SIGHUP re-reads the same flags, environment and file: engines join and leave without a restart.
        return create_app(settings, reload=lambda: parse_settings(argv, "pd-gateway serve", parser)[0])
    except ValueError as exc:
        raise SystemExit(f"pd-gateway serve: {exc}") from None


def _run(app: Any, settings: Settings, port: int, metrics_port: int | None, started: Any,
         reuse_port: bool = False) -> None:
    from gateway.connections import Limits, default_max_connections
    from gateway.serving import serve as run

    limits = Limits(settings.header_timeout_s, settings.body_timeout_s,
                    settings.max_connections or default_max_connections())
    run(app, settings.host, port, started=started, log_level=settings.log_level, limits=limits,
        keep_alive_s=settings.keep_alive_timeout_s, metrics_port=metrics_port, reuse_port=reuse_port)


def check(argv: list[str]) -> None:
    import asyncio
    import json

    from gateway.startup import check as run_check
    from gateway.telemetry import setup_logging

    parser = settings_parser("pd-gateway check", "Probe the engines and the store, print the start-up report; "
                                                 "exit 1 on a failing verdict.")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--strict", action="store_true", help="exit 1 on warnings too")
    settings, args = parse_settings(argv, "pd-gateway check", parser)
    setup_logging("error", settings.log_format)
    reports = [asyncio.run(run_check(setup.settings)) for setup in settings.deployment()]     # one per model
    if args.json:
        print(json.dumps([r.to_dict() for r in reports] if settings.models else reports[0].to_dict(), indent=2))
    else:
        print("\n\n".join("\n".join(r.lines()) for r in reports))
    verdicts = {r.verdict for r in reports}
    if "fail" in verdicts or (args.strict and "warn" in verdicts):
        raise SystemExit(1)


def migrate_parser(default_redis_url: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pd-gateway migrate", description="apply migrations/ to the Redis store")
    parser.add_argument("--redis-url", default=default_redis_url, help="the store (default: PDGW_REDIS_URL)")
    return parser


def migrate(argv: list[str]) -> None:
    import asyncio

    from redis.exceptions import RedisError

    from gateway.store.migrate import apply_migrations

    try:
        default = config.from_env().get("redis_url")
    except config.ConfigError as exc:
        raise SystemExit(f"pd-gateway migrate: {exc}") from None
    args = migrate_parser(default).parse_args(argv)
    if not args.redis_url:
        raise SystemExit("pd-gateway migrate: --redis-url (or PDGW_REDIS_URL) is required")
    try:
        applied = asyncio.run(apply_migrations(args.redis_url))
    except (RedisError, OSError) as exc:
        raise SystemExit(f"pd-gateway migrate: the store at {config.mask_url(args.redis_url)} does not answer "
                         f"({_first_line(exc)}): start Redis or fix --redis-url") from None
    print(f"applied migrations: {applied or 'none (up to date)'}")


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]


def hash_key(argv: list[str]) -> None:
    """The key comes on stdin, never as an argument: arguments show in `ps` and in shell history."""
    from gateway.api.auth import digest

    parser = argparse.ArgumentParser(
        prog="pd-gateway hash-key", description="Read one API key from stdin (its first line) and print its "
        "SHA-256 hex digest, for serve's --api-keys TENANT:DIGEST or --api-keys-file.",
        epilog="example: printf %s \"$KEY\" | pd-gateway hash-key")
    parser.parse_args(argv)
    key = sys.stdin.readline().strip()
    if not key:
        raise SystemExit("pd-gateway hash-key: no key on stdin (an empty key cannot authenticate anyone); "
                         "example: printf %s \"$KEY\" | pd-gateway hash-key")
    print(digest(key))


def usage() -> str:
    options = {"-h, --help": "this list", "--version": "print the version"}
    width = max(map(len, [*COMMANDS, *options]))
    rows = lambda table: [f"  {name:<{width}}  {text}" for name, text in table.items()]  # noqa: E731
    return "\n".join(["usage: pd-gateway COMMAND [options]   (pd-gateway COMMAND --help: that command's options)",
                      "", "commands:", *rows(COMMANDS), "", "options:", *rows(options)])


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("pd-gateway")
    except PackageNotFoundError:        # run from a checkout that was never installed
        return "unknown (not installed)"


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    command, rest = (argv[0], argv[1:]) if argv else ("", [])
    if command == "":                        # a command is required: usage on stderr, exit 2 (as argparse does)
        print(usage(), file=sys.stderr)
        raise SystemExit(2)
    if command in ("-h", "--help", "help"):
        print(usage())
    elif command == "--version":
        print(f"pd-gateway {version()}")
    elif command == "sim":
        from gateway.sim.launch import main as sim_main

        sim_main(rest)
    elif command == "serve":
        serve(rest)
    elif command == "demo":
        from gateway.demo import main as demo_main

        demo_main(rest)
    elif command == "hash-key":
        hash_key(rest)
    elif command == "migrate":
        migrate(rest)
    elif command == "check":
        check(rest)
    elif command == "verify":
        from gateway.verify.command import main as verify_main

        verify_main(rest)
    else:
        raise SystemExit(f"pd-gateway: unknown command {command!r}\n\n{usage()}")
