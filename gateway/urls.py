"""Engine, store and collector URLs in the settings: their checks, a nameserver's address, and a URL with its
password masked for logs and screens. A leaf, as config.py is: nothing here imports other gateway modules."""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit, urlunsplit

MASK = "***"


def check_url(name: str, url: str, schemes: tuple[str, ...]) -> None:
    try:
        parts = urlsplit(url)
        if "," not in parts.netloc:      # Sentinel URLs list several host:port pairs
            parts.port  # noqa: B018  (raises ValueError on a malformed port)
    except ValueError:
        raise ValueError(f"{name}: {mask_url(url)!r} is not a valid URL") from None
    if parts.scheme not in schemes or not (parts.hostname or parts.scheme == "unix" and parts.path):
        raise ValueError(f"{name}: {mask_url(url)!r} is not a valid URL (scheme must be {' or '.join(schemes)})")


def check_dns_entry(name: str, url: str) -> None:
    """`dns://NAME:PORT`: a name whose A records are the engines, all serving HTTP on PORT."""
    parts = urlsplit(url)
    if parts.port is None or parts.path.strip("/") or parts.query or parts.username:
        raise ValueError(f"{name}: {url!r}: a dns:// entry is dns://NAME:PORT (the engines' HTTP port), "
                         "nothing after the port")


def nameserver(value: str) -> tuple[str, int]:
    """`--discovery-nameserver`: `IP`, `IP:PORT` or `[IPv6]:PORT` → (IP, port); a nameserver is given by address."""
    try:
        parts = urlsplit("//" + value)
        host, port = parts.hostname or "", parts.port or 53
        ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"discovery_nameserver: {value!r} is not IP[:PORT] (a nameserver is given by its "
                         "address)") from None
    return host, port


def mask_url(url: str) -> str:
    """`redis://user:secret@host/0` → `redis://user:***@host/0`: a password never reaches a log or a screen."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return url
    if parts.password is None:
        return url
    user = parts.username or ""
    netloc = f"{user}:{MASK}@{parts.netloc.rpartition('@')[2]}"
    return urlunsplit(parts._replace(netloc=netloc))
