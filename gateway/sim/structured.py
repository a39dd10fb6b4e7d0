"""`response_format`: vLLM's structured output (guided decoding), as far as a simulated model can follow it.

vLLM masks every token the grammar forbids, so the answer is a document of the requested shape: `json_object`
any JSON object, `json_schema` one its schema accepts, `text` free text. The simulated model writes such a
document from the same seeded randomness as its words (so wrong KV still gives another answer) and stops with
EOS, or is cut at `max_tokens` as vLLM's would be. Unknown types are refused with 400, as vLLM's request
validation does.
"""

from __future__ import annotations

import json
import random
from typing import Any

from gateway.sim.hermes_tools import instance

KINDS = ("text", "json_object", "json_schema")


class StructuredOutputError(ValueError):
    """A `response_format` vLLM would refuse (HTTP 400)."""


def schema_of(response_format: Any) -> dict[str, Any] | None:
    """The JSON schema the answer must follow ({} for any object); None for free text."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict) or response_format.get("type") not in KINDS:
        raise StructuredOutputError(f"response_format type must be one of {', '.join(KINDS)}")
    kind = response_format["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    spec = response_format.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise StructuredOutputError("response_format json_schema needs json_schema.schema, an object")
    return schema


def document(rng: random.Random, schema: dict[str, Any]) -> str:
    """The answer's text: one document the schema accepts (an object with one word when it names nothing)."""
    value = instance(rng, schema)
    if schema.get("type") == "object" and value == {}:
        value = {"answer": rng.choice(("yes", "no", "maybe"))}
    return json.dumps(value, ensure_ascii=False)
