"""What the gateway knows of one engine, typed: what the engine says of itself (`probe.py` at start-up; D's KV
capacity also from the health loop's scrape) and what the gateway proved or learned of it (that it uses pinned
prompt ids, P's push identity). `Engine.facts` holds them; `/admin/engines` shows `summary()`."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from gateway.config import VLLM_DECODER_KV_BLOCKS_TTL_S, VLLM_KV_LEASE_S
from gateway.engines.kv import PushTarget


@dataclass(frozen=True)
class KvTransfer:
    """The parts of vLLM's `kv_transfer_config` that matter for PD (`/server_info`, vLLM dev mode)."""
    connector: str | None = None
    role: str | None = None
    engine_id: str | None = None
    connectors: tuple[str, ...] = ()          # a MultiConnector's own connectors (docs/protocol.md §8.5)
    failure_policy: str = "fail"
    bidirectional: bool = False
    decoder_kv_blocks_ttl: float | None = None   # None: vLLM's default (docs/protocol.md §1)
    kv_lease_duration: float | None = None       # None: vLLM's default (docs/protocol.md §9)

    @property
    def ttl_s(self) -> float:
        """How long D pins a finished turn's blocks."""
        return self.decoder_kv_blocks_ttl or VLLM_DECODER_KV_BLOCKS_TTL_S

    @property
    def lease_s(self) -> float:
        """How long D holds a local turn's KV, and P a pushed pair's unmatched finished blocks."""
        return self.kv_lease_duration or VLLM_KV_LEASE_S


@dataclass
class EngineFacts:
    models: list[str] = field(default_factory=list)     # served model names (/v1/models)
    max_model_len: int | None = None
    version: str | None = None
    block_size: int | None = None                       # KV block size in tokens (/metrics)
    num_gpu_blocks: int | None = None                   # KV capacity in blocks: D's pin budget is a share of it
    kv_transfer: KvTransfer | None = None               # None: no /server_info (vLLM without dev mode)
    pinned_ids: bool | None = None      # True once proven to use pinned prompt ids (startup.PinnedIdsProof)
    push_target: PushTarget | None = None   # push mode, a P: the identity D legs name, once learned (transfer.py)

    @property
    def served_model(self) -> str | None:
        return self.models[0] if self.models else None

    @property
    def lease_s(self) -> float:
        return self.kv_transfer.lease_s if self.kv_transfer is not None else VLLM_KV_LEASE_S

    def update(self, other: EngineFacts) -> None:
        """What a new probe read; what it could not read (None, empty) keeps what was known."""
        for name, value in vars(other).items():
            if value is not None and value != []:
                setattr(self, name, value)

    def summary(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}
