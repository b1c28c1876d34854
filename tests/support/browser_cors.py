"""What a browser concludes from CORS headers (the Fetch standard's CORS check and CORS-preflight
fetch), so tests assert what a page can do rather than header spelling.

`Headers` is any case-insensitive mapping of the answer's headers (httpx's). `credentials` is the
request's credentials mode being "include" (cookies, `fetch(..., {credentials: "include"})`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

_SAFE_METHODS = frozenset({"GET", "HEAD", "POST"})
# CORS-safelisted request headers (their values aside, which these tests keep simple).
_SAFE_HEADERS = frozenset({"accept", "accept-language", "content-language"})


def _items(value: str | None) -> set[str]:
    return {p.strip() for p in (value or "").split(",") if p.strip()}


def readable(headers: Mapping[str, str], origin: str, *, credentials: bool = False) -> bool:
    """The CORS check: may the page on `origin` read this answer?"""
    allow = headers.get("access-control-allow-origin")
    if allow is None:
        return False
    if credentials:
        return allow == origin and headers.get("access-control-allow-credentials") == "true"
    return allow in ("*", origin)


def preflight_admits(
    status: int,
    headers: Mapping[str, str],
    origin: str,
    method: str,
    request_headers: Iterable[str],
    *,
    credentials: bool = False,
) -> bool:
    """Does this preflight answer let the page send `method` with `request_headers`?"""
    if not 200 <= status < 300 or not readable(headers, origin, credentials=credentials):
        return False
    methods = _items(headers.get("access-control-allow-methods"))
    wildcard = not credentials
    if method not in _SAFE_METHODS and method not in methods and not (wildcard and "*" in methods):
        return False
    allowed = {h.lower() for h in _items(headers.get("access-control-allow-headers"))}
    for name in (h.lower() for h in request_headers):
        if name in _SAFE_HEADERS or name in allowed:
            continue
        # `*` covers every header but Authorization, and only without credentials.
        if not (wildcard and "*" in allowed and name != "authorization"):
            return False
    return True
