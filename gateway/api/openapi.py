"""The gateway's OpenAPI document, built from the same msgspec schemas that validate requests, so clients
and fuzzers see exactly what is accepted. Served at GET /openapi.json."""

from __future__ import annotations

from typing import Any

import msgspec
from litestar import Request, get
from litestar.di import NamedDependency

from gateway.api import operational
from gateway.api.auth import ApiKeys
from gateway.api.schemas import ChatRequest, CompletionRequest
from gateway.config import Settings

_REF = "#/components/schemas/{name}"
_ERROR = {
    "type": "object", "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message", "type", "param", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "integer", "null"]}}}},
}


def _errors(*statuses: int) -> dict[str, Any]:
    content = {"application/json": {"schema": {"$ref": _REF.format(name="Error")}}}
    return {str(s): {"description": "OpenAI-shaped error", "content": content} for s in statuses}


def _turn(schema: str, summary: str) -> dict[str, Any]:
    return {"post": {
        "summary": summary,
        "parameters": [{"name": "X-Session-Id", "in": "header", "required": False, "schema": {"type": "string"}}],
        "requestBody": {"required": True, "content": {
            "application/json": {"schema": {"$ref": _REF.format(name=schema)}}}},
        "responses": {"200": {"description": "the completion (JSON, or SSE when stream is true)"},
                      **_errors(400, 401, 404, 413, 429, 502, 503, 504)}}}


def _plain(summary: str) -> dict[str, Any]:
    return {"get": {"summary": summary, "responses": {"200": {"description": "OK"}}}}


def build() -> dict[str, Any]:
    _, components = msgspec.json.schema_components([ChatRequest, CompletionRequest], ref_template=_REF)
    return {
        "openapi": "3.1.0",
        "info": {"title": "pd-gateway", "version": "1"},
        "paths": {
            "/v1/chat/completions": _turn("ChatRequest", "OpenAI chat completion, run as a P leg then a D leg"),
            "/v1/completions": _turn("CompletionRequest", "OpenAI completion, run as a P leg then a D leg"),
            "/v1/models": _plain("served models"),
            "/health": _plain("alive"),
            "/ready": {"get": {"summary": "store and engines usable",
                               "responses": {"200": {"description": "ready"}, "503": {"description": "not"}}}},
        },
        "components": {"schemas": {**components, "Error": _ERROR}},
    }


DOCUMENT = msgspec.json.encode(build())


@get("/openapi.json", media_type="application/json")
async def openapi_json(request: Request, settings: NamedDependency[Settings],
                       api_keys: NamedDependency[ApiKeys]) -> bytes:
    operational.authorize(request, settings, api_keys)
    return DOCUMENT
