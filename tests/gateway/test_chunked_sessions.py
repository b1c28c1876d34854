"""A long agent session through `slotkeeper serve` stored in content-addressed chunks: what a turn
writes follows its new tokens, what the store holds follows the session, and restores stay exact
after the whole process is SIGKILLed."""

from __future__ import annotations

import json
import signal
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import httpx
import openai
import pytest
from support.servers import CREDS

MODEL = "qwen35-seed0"
SESSION = "agent-20"
# About 2,600 tokens of system prompt and tools: a turn (a short user message and an 8-token
# answer) then adds well under 10 % of the session.
SYSTEM = ("You are a coding agent with tools: read_file(path), write_file(path, text), run(cmd). "
          "Plan, act, check the result, and report briefly. ") * 60  # fmt: skip
TURNS = 20
S3_ENV = {
    "AWS_ACCESS_KEY_ID": CREDS["aws_access_key_id"],
    "AWS_SECRET_ACCESS_KEY": CREDS["aws_secret_access_key"],
}

_CLIENTS: list[openai.OpenAI] = []


@pytest.fixture(autouse=True)
def _close_clients() -> Iterator[None]:
    yield
    while _CLIENTS:
        _CLIENTS.pop().close()


def _client(url: str) -> openai.OpenAI:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    _CLIENTS.append(client)
    return client


@dataclass
class Where:
    """The store `serve` uses: its data directory, or an S3 bucket (prefix per run)."""

    endpoint: str | None
    prefix: str

    def args(self) -> tuple[str, ...]:
        base = ("--ctx", "8192", "--s3-prefix", self.prefix)
        return base + (("--s3-endpoint", self.endpoint, "--s3-bucket", "slots") if self.endpoint else ())

    def objects(self, data: Path) -> dict[str, int]:
        """Key -> size of everything stored for the tenant (chunks, checkpoints, tails, manifests)."""
        head = f"{self.prefix}/default/"
        if self.endpoint is None:
            root = data / "blobs"
            files = (p for p in (root / head).rglob("*") if p.is_file())
            return {p.relative_to(root).as_posix(): p.stat().st_size for p in files}
        client = boto3.client("s3", endpoint_url=self.endpoint, **CREDS)
        try:
            pages = client.get_paginator("list_objects_v2").paginate(Bucket="slots", Prefix=head)
            return {o["Key"]: o["Size"] for page in pages for o in page.get("Contents", [])}
        finally:
            client.close()

    def read(self, data: Path, key: str) -> bytes:
        if self.endpoint is None:
            return (data / "blobs" / key).read_bytes()
        client = boto3.client("s3", endpoint_url=self.endpoint, **CREDS)
        try:
            return bytes(client.get_object(Bucket="slots", Key=key)["Body"].read())
        finally:
            client.close()

    def stored_bytes(self, data: Path) -> int:
        return sum(self.objects(data).values())

    def newest_manifest(self, data: Path) -> dict[str, Any]:
        keys = sorted(k for k in self.objects(data) if k.endswith(".manifest") and f"/{SESSION}/" in k)
        return dict(json.loads(self.read(data, keys[-1])))


def _written(url: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith('slotkeeper_gateway_store_written_bytes_total{why="after-turn"}'):
            return float(line.split()[-1])
    return 0.0


def _wait(what: str, check: Any, timeout_s: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"{what}: not within {timeout_s} s")


def _generation(url: str) -> int:
    return int(httpx.get(f"{url}/v1/sessions/{SESSION}", timeout=5).json().get("generation", 0))


def _conversation(
    serve: Any, data: Path, where: Where, kill_every: int = 0
) -> tuple[list[tuple[str, int]], list[dict]]:
    """TURNS turns of one session; with ``kill_every`` the whole serve process is SIGKILLed after
    every that many turns (once the turn is durable) and started again on the same data."""
    s = serve(data, slots=1, args=where.args(), env=S3_ENV)
    msgs: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    answers, measured = [], []
    for turn in range(TURNS):
        msgs.append({"role": "user", "content": f"Step {turn}: run the tests and fix what fails."})
        before = _written(s.url)
        raw = _client(s.url).chat.completions.with_raw_response.create(
            model=MODEL, messages=msgs, max_tokens=8, temperature=0, extra_headers={"X-Session-Id": SESSION}
        )
        done = raw.parse()
        answer, timings = done.choices[0].message.content or "", done.model_extra["timings"]
        answers.append((answer, int(timings["prompt_n"])))
        msgs.append({"role": "assistant", "content": answer})
        _wait(f"turn {turn} durable", lambda t=turn, u=s.url: _generation(u) >= t + 1)
        if kill_every == 0:
            full = int(where.newest_manifest(data)["plan"]["size"])
            written = _written(s.url) - before
            # the superseded generation's garbage goes right after the save (no listing needed)
            _wait("storage follows the session", lambda f=full: where.stored_bytes(data) <= 1.5 * f)
            measured.append({"turn": turn, "tokens": done.usage.prompt_tokens, "full": full,
                             "written": written, "stored": where.stored_bytes(data)})  # fmt: skip
        elif (turn + 1) % kill_every == 0 and turn + 1 < TURNS:
            s.stop(signal.SIGKILL)
            s = serve(data, slots=1, args=where.args(), env=S3_ENV)
    return answers, measured


@pytest.mark.parametrize("store", ["local", "seaweedfs"])
def test_twenty_turns_write_what_is_new_and_restore_exactly_after_sigkill(
    serve: Any, tmp_path: Path, store: str, request: pytest.FixtureRequest
) -> None:
    endpoint = request.getfixturevalue("seaweed_server") if store == "seaweedfs" else None
    run = uuid.uuid4().hex[:8]
    steady, measured = _conversation(serve, tmp_path / "steady", Where(endpoint, f"steady{run}"))
    for m in measured:
        assert m["stored"] <= 1.5 * m["full"], m
    # Every turn after the first adds under 10 % of the session's tokens: it writes at most 0.35x.
    small = [
        m
        for prev, m in zip(measured, measured[1:], strict=False)
        if m["tokens"] - prev["tokens"] <= 0.1 * m["tokens"]
    ]
    assert len(small) >= TURNS - 2
    for m in small:
        assert m["written"] <= 0.35 * m["full"], m
    print("\nturn tokens full written stored")  # the numbers for the note (pytest -s)
    for m in measured:
        print(m["turn"], m["tokens"], m["full"], int(m["written"]), m["stored"],
              f"{m['written'] / m['full']:.3f} {m['stored'] / m['full']:.3f}")  # fmt: skip

    restarted, _ = _conversation(serve, tmp_path / "killed", Where(endpoint, f"killed{run}"), kill_every=4)
    assert restarted == steady  # same answers and the same prompt_n, turn by turn
