"""Label values both ends put on their Prometheus metrics, so dashboards read engines and gateways alike.

A request's `path` label is the route's template, not the raw path: `/slots/3` and `/slots/4` are
one series (`/slots/{id_slot}`), and a path no route matches is `other`, so a client cannot grow
the number of series by inventing paths.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def route_label(path: str, routes: Iterable[Any]) -> str:
    """A low-cardinality route name for a request path (`/slots/3` -> `/slots/{id_slot}`)."""
    for route in routes:
        match = getattr(route, "path_regex", None)
        if match is not None and match.match(path):
            return str(route.path)
    return "other"
