"""Client API keys → tenants. Keys are kept only as SHA-256 hex digests (in flags, env or a file), so the
configuration never holds a usable key. Without any key configured the gateway is open, with one tenant."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from gateway.config import DEFAULT_TENANT, Settings
from gateway.errors import AuthenticationError

_ENTRY = re.compile(r"([A-Za-z0-9_.-]{1,64})[:\s]+([0-9a-fA-F]{64})")


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


_EMPTY = digest("")


class ApiKeys:
    def __init__(self, tenants_by_digest: dict[str, str]) -> None:
        self._tenants = tenants_by_digest

    @classmethod
    def from_settings(cls, settings: Settings) -> ApiKeys:
        lines = list(settings.api_keys)
        if settings.api_keys_file:
            lines += Path(settings.api_keys_file).read_text().splitlines()
        tenants = {}
        for line in (raw.strip() for raw in lines):
            if not line or line.startswith("#"):
                continue
            match = _ENTRY.fullmatch(line)
            if match is None:
                raise ValueError("api_keys: each entry must be TENANT:SHA256-HEX (see `pd-gateway hash-key`)")
            if match.group(2).lower() == _EMPTY:
                raise ValueError(f"api_keys: tenant {match.group(1)}'s digest is that of an empty key: no request "
                                 "can present it (hash the key itself: `pd-gateway hash-key`)")
            tenants[match.group(2).lower()] = match.group(1)
        return cls(tenants)

    @property
    def enabled(self) -> bool:
        return bool(self._tenants)

    def tenant_for(self, authorization: str | None) -> str:
        if not self._tenants:
            return DEFAULT_TENANT
        key = (authorization or "").removeprefix("Bearer ").strip()
        tenant = self._tenants.get(digest(key)) if key else None
        if tenant is None:
            raise AuthenticationError("Incorrect API key provided.")
        return tenant
