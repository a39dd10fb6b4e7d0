"""Which KV a reader pulls from a holder: the handle it was given, and the block arithmetic vLLM applies.

Pure decisions, no I/O. vLLM checks counts, never tokens: the reader needs the `n` blocks covering the
positions it lacks and takes the LAST `n` ids of the holder's list (tail alignment), whatever they hold.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from gateway.sim.settings import EXPIRY_MARGIN_S, SimSettings
from gateway.sim.kv_reader import HolderAddress


@dataclass(frozen=True)
class KVSource:
    """A holder's handle as a reader sees it."""

    holder: HolderAddress
    block_ids: list[int]
    num_tokens: int | None  # remote_num_tokens; None on old engines' P handles: the whole prompt
    expiry: float | None  # remote_blocks_expiry_time, the holder's monotonic clock (same host)
    heartbeat: bool  # P's lease is renewed by the D request that names it

    @classmethod
    def from_params(cls, params: dict[str, Any] | None, settings: SimSettings) -> KVSource | None:
        if not settings.has_connector or not params or params.get("remote_block_ids") is None:
            return None
        if settings.transfer_mode == "push":  # nobody reads in push mode: P writes (push.py, protocol §8)
            return None
        if not params.get("remote_engine_id"):
            return None
        if settings.role == "decode" and params.get("do_remote_prefill"):
            return cls._of(params, heartbeat=True)
        if settings.role == "prefill" and params.get("do_remote_decode") and settings.bidirectional:
            return cls._of(params, heartbeat=False)
        return None

    @classmethod
    def _of(cls, params: dict[str, Any], *, heartbeat: bool) -> KVSource:
        ids = params["remote_block_ids"]
        if ids and isinstance(ids[0], list):
            ids = ids[0]  # one list per KV-cache group; the simulated model has one group
        num = params.get("remote_num_tokens")
        expiry = params.get("remote_blocks_expiry_time")
        return cls(HolderAddress.from_params(params), [int(i) for i in ids], None if num is None else int(num),
                   None if expiry is None else float(expiry), heartbeat)


def parks(params: dict[str, Any] | None, settings: SimSettings) -> bool:
    """A pull-mode P without bidirectional transfer given D's handle waits for a transfer never scheduled: a
    hang. A push-mode P ignores D's handle and prefills (nixl/push_scheduler.py:119-126)."""
    return (settings.role == "prefill" and settings.transfer_mode == "pull" and not settings.bidirectional
            and bool(params)
            and bool(params.get("do_remote_decode")) and params.get("remote_block_ids") is not None)


@dataclass(frozen=True)
class LoadPlan:
    declined: bool = False  # the handle expires within the margin: no read
    block_ids: list[int] = field(default_factory=list)  # holder ids to read; empty: notification only
    first_block: int = 0  # the reader's block index of the first id read
    missing: int = 0  # blocks needed beyond the holder's list (read as garbage)
    end: int = 0  # positions [cached, end) come from the read


def load_plan(source: KVSource, prompt_len: int, cached: int, block_size: int, threshold: int,
              now: float | None = None, margin_s: float = EXPIRY_MARGIN_S) -> LoadPlan:
    now = time.monotonic() if now is None else now
    if source.expiry is not None and source.expiry - now < margin_s:
        return LoadPlan(declined=True)
    held = prompt_len if source.num_tokens is None else source.num_tokens
    reach = min(held, prompt_len)
    end = min(reach, prompt_len - 1)  # the reader computes at least the last prompt token
    if held <= 0 or end - cached <= 0 or end - cached < threshold:
        return LoadPlan()
    first = cached // block_size
    n = (reach - 1) // block_size - first + 1
    ids = source.block_ids[-n:] if n <= len(source.block_ids) else list(source.block_ids)
    return LoadPlan(block_ids=ids, first_block=first, missing=n - len(ids), end=end)
