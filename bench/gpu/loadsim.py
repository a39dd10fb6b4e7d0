"""The load bench on timed simulators (`python bench/gpu/load.py --sim`): the same arms and code as on the GPU host,
with engines that spend an H200's time (bench/local.py's timing: prefill 50k tokens/s, an 8 ms decode step
shared by the running requests, KV moved at 0.05 ms a block plus 40 ms a read) and queue on full KV as vLLM does.

The stateless arm gets its own P and D started without bidirectional transfer: a bidirectional D pins every
request that carries `kv_transfer_params` for its decoder_kv_blocks_ttl (480 s on the simulator; docs/protocol.md),
vllm-router's stateless turns too, which filled the shared D and stalled that arm in the first sim runs; a user
of stateless PD runs engines that pin nothing. (The H200 run shares P and D, with a 120 s TTL: there the stateless
arm runs last.)

Sizes: workload lengths x `--scale`, D's KV in blocks of 16 tokens; the co-located arm gets P's and D's blocks
together, each of the two co-located engines one engine's. `--smoke` is CI's (about two minutes on two cores),
`--quick` a developer's (a few minutes); without either, the GPU quick points at a quarter of the lengths.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable

import loadstats as stats
from load import ADMIN_KEY
from bench.local import TIMING
from bench.servers import Servers, get_json

from gateway.config import DEFAULT_LOCAL_PREFILL_MAX_TOKENS

SIZES = {   # (scale, points, seconds per arm, think scale, D's blocks)
    "smoke": (0.1, "chat:c4,agent:c4", 6.0, 0.02, 6000),
    "quick": (0.25, "chat:c8,chat:c32,long:c8,agent:c8", 20.0, 0.05, 6000),
    "full": (0.25, "chat:c8,chat:c32,chat:c64,long:c16,agent:c16", 40.0, 0.1, 6000),
}
ENGINE = ["--stream-kv-params", "--max-model-len", "65536", "--batched-steps"]
# P and D publish their KV events (docs/protocol.md §10) and the gateway subscribes: the deployment docs/operations.md
# recommends, and the one the H200 run has (serve.sh KV_EVENTS=1)
EVENTS = ["--kv-events-config", '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://127.0.0.1:*",'
          '"topic":"kv"}']


def run_on_sims(args: argparse.Namespace, run: Callable[..., dict[str, Any]]) -> dict[str, Any]:
    size = "smoke" if args.smoke else "quick" if args.quick else "full"
    scale, points, duration, think, blocks = SIZES[size]
    args.scale, args.duration_s, args.think_scale = scale, duration, think
    args.points = args.points or points                 # points given on the command line win
    args.model, args.title = "demo", f"load bench on timed simulators ({size})"
    args.turn_timeout_s = min(args.turn_timeout_s, 60.0)
    flags = [*ENGINE, *TIMING]
    pd_flags = [*flags, *EVENTS, "--num-blocks", str(blocks)]
    if args.kv_mode == "push":
        pd_flags += ["--kv-transfer-mode", "push", "--no-bidirectional"]
    with Servers() as s:
        p, d, c, c1, c2, p0, d0 = s.sims([
            ("prefill", "load-p", pd_flags),
            ("decode", "load-d", pd_flags),
            ("colocated", "load-c", [*flags, "--num-blocks", str(2 * blocks)]),
            ("colocated", "load-c1", [*flags, "--num-blocks", str(blocks)]),
            ("colocated", "load-c2", [*flags, "--num-blocks", str(blocks)]),
            ("prefill", "load-p0", [*flags, "--num-blocks", str(blocks), "--no-bidirectional"]),
            ("decode", "load-d0", [*flags, "--num-blocks", str(blocks), "--no-bidirectional"])])
        events = [a for e in (p, d) for a in ("--kv-events", f"{e.url}={get_json(e.url + '/sim/stats')['kv_events_endpoint']}")]
        gateway = s.gateways([([p], [d], ["--reuse-policy", "cost", "--local-prefill-max-tokens",
                                          str(DEFAULT_LOCAL_PREFILL_MAX_TOKENS), "--admin-key", ADMIN_KEY,
                                          *events, *args.gateway_flag])])[0]
        stateless = s.router([p0], [d0])
        pair = s.router_workers([c1, c2], policy="cache_aware")
        urls = {stats.GATEWAY: gateway.url, stats.STATELESS: stateless.url, stats.COLOC: c.url,
                stats.COLOC2: pair.url}
        engines = {stats.GATEWAY: [p.url, d.url], stats.STATELESS: [p0.url, d0.url], stats.COLOC: [c.url],
                   stats.COLOC2: [c1.url, c2.url]}
        note = (f"timed simulators ({' '.join(TIMING)}, batched steps), D {blocks} blocks of 16, lengths x{scale}, "
                f"gateway: defaults (the flags bench/servers.py sets restored){' '.join(['', *args.gateway_flag])}"
                f"{', P and D in push mode' if args.kv_mode == 'push' else ''}; "
                f"stateless PD on its own P and D without bidirectional transfer")
        result = run(args, urls, engines, note)
        oracle = [get_json(e.url + "/sim/stats") for e in (p, d, c, c1, c2, p0, d0)]
        result["corrupt"] = sum(o["kv_reads_corrupt"] for o in oracle)
        result["summary"] += f" corrupt={result['corrupt']}"      # the simulators' oracle: blocks of wrong KV read
        return result
