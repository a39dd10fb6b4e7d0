"""api/openapi.py: the document describes every public path the app serves, with its methods."""

from __future__ import annotations

import re

from gateway.api.admin import ADMIN_ROUTES
from gateway.api.messages_routes import MESSAGES_ROUTES
from gateway.api.openapi import build
from gateway.api.responses_routes import RESPONSES_ROUTES
from gateway.api.routes import ROUTES


def test_every_route_and_method_is_described() -> None:
    paths = build()["paths"]
    served = set()
    for handler in [*ROUTES, *RESPONSES_ROUTES, *MESSAGES_ROUTES, *ADMIN_ROUTES]:
        for path in handler.paths:
            for method in handler.http_methods:
                served.add((re.sub(r"\{(\w+):\w+\}", r"{\1}", path), method.lower()))
    described = {(path, method) for path, item in paths.items() for method in item}
    assert served <= described, served - described
    assert {path for path, _ in described} == {path for path, _ in served}
