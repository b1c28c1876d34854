"""Chat completions and their chunk streams as the engine's chat path makes them: what the Responses
and Messages translations read, built without an engine."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def tool_call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    """One entry of a chat message's `tool_calls`."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def weather_lookup(
    ids: tuple[str, str], content: str, reasoning: str, results: tuple[str, str]
) -> list[dict[str, Any]]:
    """An assistant turn in chat messages: `content` and `reasoning` with two get_weather calls
    (Paris, then Rome; ids `ids`), followed by the tools' `results`."""
    calls = [
        tool_call(ids[0], "get_weather", '{"city": "Paris"}'),
        tool_call(ids[1], "get_weather", '{"city": "Rome"}'),
    ]
    return [
        {"role": "assistant", "content": content, "reasoning_content": reasoning, "tool_calls": calls},
        *({"role": "tool", "tool_call_id": i, "content": r} for i, r in zip(ids, results, strict=True)),
    ]


def completion(
    content: str | None = None,
    *,
    reasoning: str = "",
    calls: Sequence[tuple[str, str, str]] = (),
    finish: str = "stop",
    stopping_word: str = "",
    prompt: int = 20,
    completion_tokens: int = 5,
    cached: int = 0,
    reasoning_tokens: int = 0,
) -> dict[str, Any]:
    """A `chat.completion` as run_chat returns it; `calls` are (id, name, arguments)."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = [tool_call(*call) for call in calls]
    choice: dict[str, Any] = {
        "index": 0,
        "message": message,
        "logprobs": None,
        "finish_reason": "tool_calls" if calls else finish,
    }
    if stopping_word:
        choice["stopping_word"] = stopping_word
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": "engine-model",
        "choices": [choice],
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached},
            "completion_tokens_details": {"reasoning_tokens": reasoning_tokens},
        },
        "timings": {"cache_n": cached, "prompt_n": prompt - cached},
    }


def chunks_of(chat: dict[str, Any], *, piece: int = 3, usage: bool = True) -> list[dict[str, Any]]:
    """The chunk stream run_chat sends for `chat` (stream_options.include_usage when `usage`):
    a role chunk, reasoning and content in `piece`-character deltas, each tool call as a head and
    its arguments, the finish chunk (with `stopping_word`), then the usage chunk."""
    head = {"id": chat["id"], "object": "chat.completion.chunk", "created": 1, "model": chat["model"]}
    choice = chat["choices"][0]
    message = choice["message"]

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        out = {**head, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
        if usage:
            out["usage"] = None
        return out

    out = [chunk({"role": "assistant", "content": ""})]
    for key in ("reasoning_content", "content"):
        text = message.get(key) or ""
        out += [chunk({key: text[i : i + piece]}) for i in range(0, len(text), piece)]
    for n, call in enumerate(message.get("tool_calls") or []):
        fn = call["function"]
        out.append(
            chunk(
                {
                    "tool_calls": [
                        {
                            "index": n,
                            "id": call["id"],
                            "type": "function",
                            "function": {"name": fn["name"], "arguments": ""},
                        }
                    ]
                }
            )
        )
        out.append(chunk({"tool_calls": [{"index": n, "function": {"arguments": fn["arguments"]}}]}))
    last = chunk({}, choice["finish_reason"])
    if "stopping_word" in choice:
        last["choices"][0]["stopping_word"] = choice["stopping_word"]
    out.append(last)
    if usage:
        out.append({**head, "choices": [], "usage": chat["usage"]})
    return out
