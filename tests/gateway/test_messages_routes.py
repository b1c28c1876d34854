"""Anthropic Messages through `slotkeeper serve` with the official `anthropic` client: a forced tool,
the tool_result follow-up reusing the prefix (cache_read_input_tokens), streaming, count_tokens,
x-api-key tenants, and precise errors in Anthropic's shape."""

from __future__ import annotations

from pathlib import Path

import anthropic
import httpx
import pytest

from .conftest import AGENT_SYSTEM, READ_FILE, add_tool_result, anthropic_client, read_file_turn


def tool_round_trip(client: anthropic.Anthropic, session: str | None = None) -> tuple[list, list]:
    """A forced tool call, then its tool_result: (the two responses, the messages sent)."""
    headers = {"X-Session-Id": session} if session else {}
    messages: list[dict] = [{"role": "user", "content": "Open the README, please."}]
    first = read_file_turn(client, messages, forced=True, headers=headers).parse()
    uses = [b for b in first.content if b.type == "tool_use"]
    assert first.stop_reason == "tool_use" and uses and uses[0].name == "read_file"
    assert isinstance(uses[0].input, dict) and isinstance(uses[0].input["path"], str)
    add_tool_result(messages, first, "# Slotkeeper\nIt saves slots.")
    second = read_file_turn(client, messages, forced=False, headers=headers).parse()
    return [first, second], messages


def test_a_forced_tool_then_its_result_reuses_the_prefix(serve, tmp_path: Path):
    s = serve(tmp_path / "data")
    client = anthropic_client(s.url)
    (first, second), messages = tool_round_trip(client)
    # The follow-up found its session by its history (no id sent) and reused everything before it.
    total_first = first.usage.input_tokens + (first.usage.cache_read_input_tokens or 0)
    assert (second.usage.cache_read_input_tokens or 0) >= total_first

    count = client.messages.count_tokens(
        model="claude-test-agent",
        system=AGENT_SYSTEM,
        messages=messages,
        tools=[READ_FILE],  # type: ignore[arg-type,list-item]
    )
    assert count.input_tokens == second.usage.input_tokens + (second.usage.cache_read_input_tokens or 0)

    # Streamed: the SDK's accumulator rebuilds the same message as the non-streamed call.
    with client.messages.stream(
        model="claude-test-agent",
        system=AGENT_SYSTEM,
        max_tokens=8,
        extra_body={"temperature": 0},
        messages=messages,
        tools=[READ_FILE],  # type: ignore[arg-type,list-item]
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert [(b.type, getattr(b, "text", None)) for b in final.content] == [
        (b.type, getattr(b, "text", None)) for b in second.content
    ]
    assert text == second.content[0].text  # type: ignore[union-attr]
    assert final.stop_reason == second.stop_reason
    assert (final.usage.cache_read_input_tokens or 0) > 0


def test_keys_as_x_api_key_and_errors_in_anthropic_shape(serve, tmp_path: Path):
    tenants = tmp_path / "tenants.toml"
    tenants.write_text('[tenants.a]\nkeys = ["key-a"]\nmodels = { "claude-*" = "qwen35-seed0" }\n')
    s = serve(tmp_path / "data", tenants=tenants)
    ok = anthropic_client(s.url, "key-a").messages.create(
        model="claude-test-mini", max_tokens=4, messages=[{"role": "user", "content": "hi"}]
    )
    assert ok.type == "message" and ok.role == "assistant"
    with pytest.raises(anthropic.AuthenticationError):
        anthropic_client(s.url, "wrong").messages.create(
            model="claude-test-mini", max_tokens=4, messages=[{"role": "user", "content": "hi"}]
        )
    with pytest.raises(anthropic.NotFoundError):
        anthropic_client(s.url, "key-a").messages.create(
            model="gpt-4o", max_tokens=4, messages=[{"role": "user", "content": "hi"}]
        )
    bad = [
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image",
                            "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"},
                        }
                    ],
                }
            ]
        },
        {"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]},
        {"messages": [{"role": "user", "content": [{"type": "no_such_block", "text": "x"}]}]},
        {"messages": "hello"},
    ]
    for body in bad:
        resp = httpx.post(
            f"{s.url}/v1/messages",
            headers={"x-api-key": "key-a", "anthropic-version": "2023-06-01"},
            json={"model": "claude-test-mini", "max_tokens": 4, **body},
        )
        assert resp.status_code == 400, resp.text
        err = resp.json()
        assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
        assert err["error"]["message"]
    missing = httpx.post(f"{s.url}/v1/messages", headers={"x-api-key": "nope"}, json={})
    assert missing.status_code == 401 and missing.json()["error"]["type"] == "authentication_error"
