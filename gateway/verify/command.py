"""`pd-gateway verify --gateway URL --prefill URL... --decode URL... --baseline URL [--json] [--quick]`: flags ->
Options -> run -> report; exit 0 when every case passed and every negative control was caught, else 1."""

from __future__ import annotations

import argparse
import asyncio
import json
import os

from gateway.verify import report
from gateway.verify.run import DEFAULT_TENANT, DEFAULT_TIMEOUT_S, Options, VerifyError, verify

DESCRIPTION = ("Before a rollout: send a fixed, seeded suite through the gateway and the same requests to a "
               "co-located baseline engine (same model, prefix caching on), judge each answer (greedy equality "
               "where the engines are deterministic, else the first token's top-k logprob distance against the "
               "baseline's own noise), and read KV wrongly on purpose straight at P and D (a handle longer than "
               "the prompt, another conversation's handle) to show the measure catches it. Exit 1 on any "
               "finding.")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pd-gateway verify", description=DESCRIPTION)
    p.add_argument("--gateway", required=True, help="the gateway's base URL")
    p.add_argument("--prefill", nargs="+", action="extend", required=True, help="P engines' base URLs")
    p.add_argument("--decode", nargs="+", action="extend", required=True, help="D engines' base URLs")
    p.add_argument("--baseline", required=True, help="a co-located engine of the same model (no KV connector)")
    p.add_argument("--model", help="served model name (default: the gateway's first model)")
    p.add_argument("--api-key", default=os.environ.get("PDGW_VERIFY_API_KEY"),
                   help="client key for the gateway when it requires one (env PDGW_VERIFY_API_KEY)")
    p.add_argument("--tenant", default=DEFAULT_TENANT, help="the tenant of --api-key (for the clean-up)")
    p.add_argument("--admin-key", default=os.environ.get("PDGW_ADMIN_KEY"),
                   help="the gateway's admin key: the run's conversations are deleted afterwards, releasing the D "
                        "blocks their handles pin (env PDGW_ADMIN_KEY)")
    p.add_argument("--timeout-s", type=float, default=DEFAULT_TIMEOUT_S, help="deadline of each request")
    p.add_argument("--quick", action="store_true", help="fewer cases, shorter answers, one P-D pair's controls")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    return p


def main(argv: list[str]) -> None:
    args = parser().parse_args(argv)
    options = Options(args.gateway, args.prefill, args.decode, args.baseline, model=args.model,
                      api_key=args.api_key, admin_key=args.admin_key, tenant=args.tenant, quick=args.quick,
                      timeout_s=args.timeout_s)
    try:
        result = asyncio.run(verify(options))
    except VerifyError as exc:
        raise SystemExit(f"pd-gateway verify: {exc}") from None
    print(json.dumps(report.to_dict(result), indent=2) if args.json else "\n".join(report.lines(result)))
    if not result.passed:
        raise SystemExit(1)
