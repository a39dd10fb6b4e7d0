"""The oracle's counters, served at `GET /sim/stats` and partly as vLLM's Prometheus metrics."""

from __future__ import annotations

import msgspec


class SimStats(msgspec.Struct, kw_only=True):
    requests_total: int = 0
    requests_failed: int = 0
    requests_aborted: int = 0
    prompt_tokens_computed: int = 0  # prefilled locally (including every recompute)
    prompt_tokens_loaded: int = 0  # KV read from another engine
    prompt_tokens_cached: int = 0  # local prefix-cache hits
    generation_tokens: int = 0
    kv_reads_total: int = 0  # data reads this engine made from a holder
    kv_blocks_read: int = 0
    kv_reads_corrupt: int = 0  # blocks used (loaded or cache hits) whose KV is not this prompt's
    requests_corrupt: int = 0  # requests that used at least one such block
    kv_reads_skipped: int = 0  # below kv_recompute_threshold (or zero tokens): holder only notified
    kv_reads_declined: int = 0  # handle within the expiry margin
    requests_parked: int = 0  # declined under `recompute`: never answered (vLLM 0.32), until the client leaves
    kv_load_failures: int = 0  # holder unreachable or handshake refused
    notifications_sent: int = 0
    heartbeats_sent: int = 0
    heartbeats_received: int = 0
    handles_leased: int = 0  # P handles issued
    handles_pinned_total: int = 0  # D handles issued
    handles_consumed: int = 0  # first read or notification of a live handle
    handles_expired: int = 0  # leases and pins that ran out unread
    handles_double_read: int = 0  # reads/notifications of an already spent (or unknown) handle: the four below
    handles_reread: int = 0  # a read of a handle spent on this instance: garbage, a gateway bug
    handles_read_unknown: int = 0  # a read of a handle this instance never issued: garbage too
    handles_renotified: int = 0  # a notification (release, abort) of a handle spent on this instance: ignored
    handles_notified_unknown: int = 0  # a notification of a handle this instance never issued: ignored
    handles_read_after_expiry: int = 0  # reads/notifications of an expired handle (stale memory)
    requests_waited_for_blocks: int = 0  # queued because the pool had too few free blocks (vLLM: stays waiting)
    block_wait_seconds_total: float = 0.0  # summed over those requests, from queueing to admission (or leaving)
    block_wait_seconds_max: float = 0.0
    requests_preempted: int = 0  # no free block for the answer: blocks given back, recomputed later (vLLM)
    holds_skipped_no_blocks: int = 0  # finished without a handle: no free block for the answer's KV
    # push mode (docs/protocol.md §8): on D
    push_registrations_sent: int = 0  # D's blocks registered with P
    push_registrations_timed_out: int = 0  # push_registration_timeout passed: logged, the request still waits
    push_writes_received: int = 0  # P's writes that completed a waiting request
    push_blocks_received: int = 0
    push_writes_after_abort: int = 0  # a write for an aborted request: its held blocks freed then
    push_writes_unmatched: int = 0  # a write no request waits for
    # ... and on P
    push_registrations_received: int = 0
    push_writes_sent: int = 0
    push_blocks_written: int = 0
    push_writes_failed: int = 0  # D unreachable, or D registered more blocks than P holds: no write, D not told
    push_writes_withheld: int = 0  # --push-fault never-write
