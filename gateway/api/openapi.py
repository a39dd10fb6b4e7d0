"""The gateway's OpenAPI document, built from the same msgspec schemas that validate requests, so clients
and fuzzers see exactly what is accepted: every public path (chat, completions, Responses, Messages, models,
health, metrics, admin). Served at GET /openapi.json."""

from __future__ import annotations

from typing import Any

import msgspec
from litestar import Request, get
from litestar.di import NamedDependency

from gateway.api import operational
from gateway.api.auth import ApiKeys
from gateway.api.messages import MessagesRequest
from gateway.api.responses import ResponsesRequest
from gateway.api.schemas import ChatRequest, CompletionRequest
from gateway.config import Settings

_REF = "#/components/schemas/{name}"
_ERROR = {
    "type": "object", "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message", "type", "param", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "integer", "null"]}}}},
}


_ANTHROPIC_ERROR = {
    "type": "object", "required": ["type", "error"],
    "properties": {"type": {"const": "error"}, "error": {"type": "object", "required": ["type", "message"],
                                                         "properties": {"type": {"type": "string"},
                                                                        "message": {"type": "string"}}}},
}
_TURN_ERRORS = (400, 401, 404, 413, 429, 502, 503, 504)


def _errors(*statuses: int, shape: str = "Error") -> dict[str, Any]:
    content = {"application/json": {"schema": {"$ref": _REF.format(name=shape)}}}
    kind = "Anthropic-shaped" if shape == "AnthropicError" else "OpenAI-shaped"
    return {str(s): {"description": f"{kind} error", "content": content} for s in statuses}


def _turn(schema: str, summary: str, shape: str = "Error") -> dict[str, Any]:
    return {"post": {
        "summary": summary,
        "parameters": [{"name": "X-Session-Id", "in": "header", "required": False, "schema": {"type": "string"}}],
        "requestBody": {"required": True, "content": {
            "application/json": {"schema": {"$ref": _REF.format(name=schema)}}}},
        "responses": {"200": {"description": "the answer (JSON, or SSE when stream is true)"},
                      **_errors(*_TURN_ERRORS, shape=shape)}}}


def _plain(summary: str) -> dict[str, Any]:
    return {"get": {"summary": summary, "responses": {"200": {"description": "OK"}}}}


def _path_param(name: str) -> list[dict[str, Any]]:
    return [{"name": name, "in": "path", "required": True, "schema": {"type": "string"}}]


def _admin(method: str, summary: str, **extra: Any) -> dict[str, Any]:
    return {method: {"summary": f"{summary} (admin key as `Authorization: Bearer KEY`)", **extra,
                     "responses": {"200": {"description": "OK"}, **_errors(400, 401, 404)}}}


def _other_paths() -> dict[str, Any]:
    response_id = _path_param("response_id")
    session = _path_param("session_id")
    tenant = [{"name": "tenant", "in": "query", "required": False, "schema": {"type": "string"}}]
    engine = {"type": "object", "required": ["role", "url"], "properties": {
        "role": {"enum": ["prefill", "decode"]}, "url": {"type": "string"}}}
    return {
        "/v1/responses": _turn("ResponsesRequest", "OpenAI Responses API, run as a chat turn"),
        "/v1/responses/{response_id}": {
            "get": {"summary": "a stored response", "parameters": response_id,
                    "responses": {"200": {"description": "the response object"}, **_errors(401, 404)}},
            "delete": {"summary": "delete a stored response", "parameters": response_id,
                       "responses": {"200": {"description": "deleted"}, **_errors(401, 404)}}},
        "/v1/messages": _turn("MessagesRequest", "Anthropic Messages API, run as a chat turn", "AnthropicError"),
        "/v1/messages/count_tokens": {"post": {
            "summary": "the prompt's tokens as rendered with the model's chat template",
            "requestBody": {"required": True, "content": {
                "application/json": {"schema": {"$ref": _REF.format(name="MessagesRequest")}}}},
            "responses": {"200": {"description": "{\"input_tokens\": N}"},
                          **_errors(400, 401, 404, 413, shape="AnthropicError")}}},
        "/metrics": {"get": {"summary": "Prometheus metrics", "responses": {"200": {
            "description": "text exposition format", "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
        "/openapi.json": _plain("this document"),
        "/admin/conversations/{session_id}": {
            **_admin("get", "a conversation's state", parameters=session + tenant),
            **_admin("delete", "drop a conversation and release D's pinned blocks", parameters=session + tenant)},
        "/admin/engines": {
            **_admin("get", "the engines and their health"),
            **_admin("post", "add an engine", requestBody={"required": True, "content": {
                "application/json": {"schema": engine}}}),
            **_admin("delete", "remove an engine", parameters=[
                {"name": "role", "in": "query", "required": True, "schema": {"enum": ["prefill", "decode"]}},
                {"name": "url", "in": "query", "required": True, "schema": {"type": "string"}}])},
    }


def build() -> dict[str, Any]:
    _, components = msgspec.json.schema_components(
        [ChatRequest, CompletionRequest, ResponsesRequest, MessagesRequest], ref_template=_REF)
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
            **_other_paths(),
        },
        "components": {"schemas": {**components, "Error": _ERROR, "AnthropicError": _ANTHROPIC_ERROR}},
    }


DOCUMENT = msgspec.json.encode(build())


@get("/openapi.json", media_type="application/json")
async def openapi_json(request: Request, settings: NamedDependency[Settings],
                       api_keys: NamedDependency[ApiKeys]) -> bytes:
    operational.authorize(request, settings, api_keys)
    return DOCUMENT
