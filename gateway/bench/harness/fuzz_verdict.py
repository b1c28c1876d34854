"""Sending a fuzz case and judging the answer: 2xx, or a 4xx in the API's error shape, never a 5xx.

Shared by tests/gateway/test_fuzz.py, tests/engine_pool/server/test_fuzz.py and `slotkeeper bench
fuzz`. A streamed 200 is read to its end: an error event that reports a server fault (OpenAI's
`server_error`, Anthropic's `api_error`) counts as a 5xx, because it is one that started late.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import httpx
from hypothesis import HealthCheck, settings

from gateway.bench.harness.fuzz_bodies import Case
from gateway.bench.harness.fuzz_specs import Endpoint

EXAMPLES = 30  # per endpoint in the suite's fuzz: a fixed budget, so each file stays well under a minute

FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)

_SERVER_FAULTS = {"server_error", "api_error", "upstream_error", "timeout_error"}


@dataclass(frozen=True)
class Answer:
    status: int  # 0: no answer (the connection failed or timed out)
    content_type: str
    body: bytes
    failure: str = ""  # why there was no answer

    def text(self, limit: int = 2000) -> str:
        return self.body[:limit].decode("utf-8", "replace")


def send(
    client: httpx.Client, endpoint: Endpoint, case: Case, headers: dict[str, str] | None = None
) -> Answer:
    try:
        r = client.post(
            endpoint.path, content=case.body, headers={"content-type": "application/json", **(headers or {})}
        )
    except httpx.HTTPError as exc:
        return Answer(0, "", b"", failure=f"{type(exc).__name__}: {exc}")
    return Answer(r.status_code, r.headers.get("content-type", ""), r.content)


def _error_shape(style: str, payload: Any) -> str:
    """'' when `payload` is an error in `style`'s shape, else what is wrong with it."""
    if style == "anthropic":
        err = payload.get("error") if isinstance(payload, dict) else None
        ok = (
            isinstance(payload, dict)
            and payload.get("type") == "error"
            and isinstance(err, dict)
            and isinstance(err.get("type"), str)
            and isinstance(err.get("message"), str)
        )
        return "" if ok else "not Anthropic's {'type': 'error', 'error': {type, message}}"
    err = payload.get("error") if isinstance(payload, dict) else None
    ok = isinstance(err, dict) and isinstance(err.get("message"), str) and isinstance(err.get("type"), str)
    return "" if ok else "not OpenAI's {'error': {message, type, ...}}"


def _stream_fault(style: str, body: bytes) -> str:
    """The first server-fault error event in an SSE body, or ''."""
    for line in body.split(b"\n"):
        if not line.startswith(b"data:"):
            continue
        try:
            event = json.loads(line[5:])
        except ValueError:
            continue
        err = event.get("error") if isinstance(event, dict) else None
        if isinstance(err, dict) and (
            err.get("type") in _SERVER_FAULTS or err.get("code") == "internal_error"
        ):
            return f"error event {err.get('type')}: {err.get('message')}"
        response = event.get("response") if isinstance(event, dict) else None  # Responses' failed event
        if isinstance(response, dict) and isinstance(response.get("error"), dict):
            rerr = response["error"]
            if rerr.get("code") in ("server_error", "internal_error"):
                return f"response.failed {rerr.get('code')}: {rerr.get('message')}"
    return ""


def verdict(endpoint: Endpoint, answer: Answer) -> str:
    """'' when the answer is acceptable for any body, else what is wrong with it."""
    if answer.status == 0:
        return f"no answer: {answer.failure}"
    if answer.status >= 500:
        return f"{answer.status}: {answer.text(500)}"
    if 400 <= answer.status < 500:
        try:
            payload = json.loads(answer.body)
        except ValueError:
            return f"{answer.status} without a JSON body: {answer.text(200)!r}"
        wrong = _error_shape(endpoint.style, payload)
        return f"{answer.status} {wrong}: {answer.text(300)}" if wrong else ""
    if 200 <= answer.status < 300:
        if answer.content_type.startswith("text/event-stream"):
            fault = _stream_fault(endpoint.style, answer.body)
            return f"{answer.status} stream with a server fault: {fault}" if fault else ""
        try:
            json.loads(answer.body)
        except ValueError:
            return f"{answer.status} without a JSON body: {answer.text(200)!r}"
        return ""
    return f"unexpected status {answer.status}"
