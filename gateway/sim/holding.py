"""The end of a request that finished normally (stop or length): its output's KV written after the prompt's and
the full blocks cached, as vLLM caches decode; then its blocks leased (P, for D's read) or pinned (D, for the
next turn's read) behind the handle the engine returns, or freed."""

from __future__ import annotations

from typing import Any, Protocol

from gateway.sim.blocks import BlockPool, block_hashes
from gateway.sim.handles import HandleTable
from gateway.sim.push import PushSender
from gateway.sim.engine_request import Running
from gateway.sim.settings import SimSettings
from gateway.sim.stats import SimStats


class Holds(Protocol):
    """What the end of a request uses of its engine, read afresh on every call (a reset swaps them)."""
    settings: SimSettings
    push_sender: PushSender
    pool: BlockPool
    handles: HandleTable
    stats: SimStats
    bs: int


class Holding:
    def __init__(self, engine: Holds) -> None:
        self.engine = engine

    def finish(self, run: Running) -> dict[str, Any] | None:
        e = self.engine
        params, prompt, s = run.req.kv_params, run.req.prompt, e.settings
        kv_len = len(prompt) + len(run.answer.token_ids) - 1  # the last sampled token has no KV
        if not self._extend(run, kv_len):
            e.stats.holds_skipped_no_blocks += 1
            e.pool.release(run.table)
            return None
        if s.has_connector and params and params.get("do_remote_decode"):
            # Held for a remote reader, whatever the engine's role: the request's flags decide (vLLM 0.32
            # nixl/pull_scheduler.py:212-213). On D (the local path) a producer's lease too, for D's
            # kv_lease_duration, no expiry in the handle, prompt + output - 1 tokens (tests/vllm/test_local.py).
            handle = self._hold(run, kv_len, s.kv_lease_duration, "lease")
            if s.role == "prefill":
                e.push_sender.finished(run.req.request_id, handle["remote_block_ids"][0])  # push mode only
            return handle
        if s.role == "decode" and s.bidirectional and params is not None:
            return self._hold(run, kv_len, s.decoder_kv_blocks_ttl, "pin")
        e.pool.release(run.table)
        return None

    def _extend(self, run: Running, kv_len: int) -> bool:
        pool, bs = self.engine.pool, self.engine.bs
        seq = run.req.prompt + run.answer.token_ids
        need = -(-kv_len // bs) - len(run.table)
        if need > 0:
            if need > pool.num_free:
                return False
            run.table += pool.allocate(need)
        for p in range(len(run.req.prompt), kv_len):
            pool.blocks[run.table[p // bs]].slots.append((seq[p], p))
        hashes = block_hashes(seq[:kv_len], bs, run.req.cache_salt)
        pool.commit_run(run.table, hashes, seq, run.num_hits, run.req.cache_salt)
        return True

    def _hold(self, run: Running, num_tokens: int, ttl: float, kind: str) -> dict[str, Any]:
        e = self.engine
        pool, bs = e.pool, e.bs
        n = -(-num_tokens // bs)
        held, rest = run.table[:n], run.table[n:]
        pool.release(rest)
        rid = run.req.request_id
        expires_at = e.handles.hold(rid, held, ttl, kind)  # type: ignore[arg-type]
        s = e.settings
        common = {"remote_block_ids": [held], "remote_engine_id": s.engine_id, "remote_request_id": rid,
                  "remote_host": s.host, "remote_port": s.port, "tp_size": 1, "dcp_size": 1, "pp_size": 1,
                  "remote_num_tokens": num_tokens}
        if kind == "lease":
            e.stats.handles_leased += 1
            return {"do_remote_prefill": True, "do_remote_decode": False, **common, "remote_blocks_expiry_time": None,
                    "remote_prefill_cached_tokens": run.num_hits * bs, "transfer_mode": s.transfer_mode}
        e.stats.handles_pinned_total += 1
        return {"do_remote_decode": True, "do_remote_prefill": False, **common,
                "remote_blocks_expiry_time": expires_at, "transfer_mode": "pull"}
