"""One simulated engine's settings: the flags of `pd-gateway sim`, as a value object."""

from __future__ import annotations

import uuid
from typing import Literal

import msgspec

from gateway.sim.kvevents import KVEventsConfig

Role = Literal["prefill", "decode", "colocated"]
FailurePolicy = Literal["recompute", "fail"]
TransferMode = Literal["pull", "push"]  # NixlConnector (READ by D) or NixlPushConnector (WRITE by P), protocol §8
# Test faults of a push-mode P (docs/protocol.md §8.4): its P legs fail with HTTP 500 after prefilling, or it
# answers but never writes (vLLM 0.32 logs a failed P->D handshake or WRITE submission and tells D nothing).
PushFault = Literal["none", "fail-prefill", "never-write"]

DEFAULT_BLOCK_SIZE = 16
DEFAULT_NUM_BLOCKS = 4096
DEFAULT_MAX_MODEL_LEN = 32768
DEFAULT_LEASE_S = 30.0
DEFAULT_PIN_TTL_S = 480.0
DEFAULT_RECOMPUTE_THRESHOLD = 64
DEFAULT_VERSION = "0.32.0"
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048   # vLLM's default for the OpenAI server with chunked prefill
# vLLM declines a read whose handle expires within this margin (same-host monotonic clock).
EXPIRY_MARGIN_S = 5.0


class SimSettings(msgspec.Struct, kw_only=True, frozen=True):
    role: Role = "colocated"
    host: str = "127.0.0.1"
    port: int = 0
    engine_id: str = msgspec.field(default_factory=lambda: str(uuid.uuid4()))
    model: str = "demo"
    tokenizer: str = "builtin:demo"
    chat_template: str | None = None  # path to a Jinja file overriding the tokenizer's template
    block_size: int = DEFAULT_BLOCK_SIZE
    num_blocks: int = DEFAULT_NUM_BLOCKS
    max_model_len: int = DEFAULT_MAX_MODEL_LEN
    bidirectional: bool = True
    kv_lease_duration: float = DEFAULT_LEASE_S
    decoder_kv_blocks_ttl: float = DEFAULT_PIN_TTL_S
    expiry_margin_s: float = EXPIRY_MARGIN_S  # vLLM's constant; lowered only to compress time in benchmarks
    kv_recompute_threshold: int | None = None  # None: 64 when bidirectional, else 0
    kv_load_failure_policy: FailurePolicy = "fail"
    prefix_caching: bool = True
    stream_kv_params: bool = False
    canonical: bool = True
    reasoning: bool = False
    honour_prompt_token_ids: bool = True
    prefill_ms_per_token: float = 0.0
    decode_ms_per_token: float = 0.0
    transfer_ms_per_block: float = 0.0  # paid by the engine that moves the KV: D's READ (pull), P's WRITE (push)
    transfer_mode: TransferMode = "pull"
    push_registration_timeout: float | None = None  # None: decoder_kv_blocks_ttl, as vLLM defaults it
    push_fault: PushFault = "none"
    transfer_ms_per_read: float = 0.0     # a read's (or push write's) fixed part: scheduling, notification
    batched_steps: bool = False           # steps shared by running requests (sim/steps.py); off: each on its own
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_num_seqs: int = 256
    output_tokens: tuple[int, int] = (8, 40)
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None   # "hermes" (the only one simulated)
    tool_call_rate: float = 0.5           # how often the model calls a tool when tool_choice is "auto"
    tool_call_style: Literal["template", "varied"] = "template"
    tool_call_rounds: int = 0             # rounds of calls after which the model answers in text (0: no limit)
    version: str = DEFAULT_VERSION
    kv_events: KVEventsConfig | None = None   # --kv-events-config: publish the prefix cache's changes

    def __post_init__(self) -> None:
        if self.transfer_mode == "push" and self.bidirectional and self.has_connector:
            # vLLM 0.32 refuses to start (nixl/push_scheduler.py:72-75), docs/protocol.md §8.1
            raise ValueError("Bidirectional KV transfer is not supported for NIXL push connector.")

    @property
    def registration_timeout(self) -> float:
        """D's soft watchdog on a push registration (nixl/push_scheduler.py:96-101)."""
        if self.push_registration_timeout is not None:
            return self.push_registration_timeout
        return self.decoder_kv_blocks_ttl

    @property
    def recompute_threshold(self) -> int:
        if self.kv_recompute_threshold is not None:
            return self.kv_recompute_threshold
        return DEFAULT_RECOMPUTE_THRESHOLD if self.bidirectional else 0

    @property
    def has_connector(self) -> bool:
        return self.role != "colocated"
