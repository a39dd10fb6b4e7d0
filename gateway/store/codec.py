"""msgpack encoding of records and handles, shared by every store so they all round-trip alike."""

from __future__ import annotations

from typing import Any

import msgspec

from .base import Conversation, StoreUnavailableError, StoredResponse

_encoder = msgspec.msgpack.Encoder()
_record_decoder = msgspec.msgpack.Decoder(Conversation)
_handle_decoder = msgspec.msgpack.Decoder(dict[str, Any])
_response_decoder = msgspec.msgpack.Decoder(StoredResponse)


def encode_record(record: Conversation) -> bytes:
    return _encoder.encode(record)


def encode_handle(handle: dict[str, Any]) -> bytes:
    return _encoder.encode(handle)


def decode_record(blob: bytes) -> Conversation:
    try:
        return _record_decoder.decode(blob)
    except msgspec.DecodeError as exc:
        # Keys carry the layout version, so this is corruption, not drift: serve the turn stateless.
        raise StoreUnavailableError(f"undecodable conversation record: {exc}") from exc


def decode_handle(blob: bytes) -> dict[str, Any]:
    try:
        return _handle_decoder.decode(blob)
    except msgspec.DecodeError as exc:
        raise StoreUnavailableError(f"undecodable handle: {exc}") from exc


def encode_response(response: StoredResponse) -> bytes:
    return _encoder.encode(response)


def decode_response(blob: bytes) -> StoredResponse:
    try:
        return _response_decoder.decode(blob)
    except msgspec.DecodeError as exc:
        raise StoreUnavailableError(f"undecodable stored response: {exc}") from exc
