"""A request as the simulated engine runs it, and what it holds while it runs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gateway.sim.generate import Answer
from gateway.sim.hermes_tools import ToolSpec


@dataclass
class EngineRequest:
    request_id: str  # internal id: what handles carry
    prompt: list[int]
    max_tokens: int
    kv_params: dict[str, Any] | None = None
    cache_salt: str | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    seed: int | None = None
    stop: list[str] | None = None
    tools: ToolSpec | None = None        # what the request lets the model call
    schema: dict[str, Any] | None = None  # response_format: the JSON schema the answer follows (structured.py)


@dataclass
class Running:
    req: EngineRequest
    table: list[int]  # block ids, in position order
    num_hits: int  # leading blocks that came from the local prefix cache
    answer: Answer
    digest: bytes = b""     # the effective context's digest: the answer's, and its logprobs', seed
    done: bool = field(default=False)
