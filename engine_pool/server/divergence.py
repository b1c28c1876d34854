"""Where a chat prompt left the state it was compared with, in the conversation's own terms.

The core reports, for every request, the state it compared the prompt with (the request's slot,
the slot it started from, or the source sharing the most with it) and their common prefix in
tokens (`native.Timings.common_n`). A turn that continues a conversation leaves that state inside
its last reply (templates re-render a past assistant turn: reasoning stripped, text tokenized
again) or at its end; anything earlier is a *miss*: the system prompt, the tools or an earlier
message changed, and everything after it was evaluated again. `locate` names that part the way a
user debugging a slow agent needs it: `system`, `tools`, `message` (with its index and role), or
`reply` (the expected case: the last reply as re-rendered).

It finds message boundaries as the checkpoint hints do: rendering a prefix of the conversation on
its own and taking its common token prefix with the whole prompt. A miss costs O(log n) renders
(binary search over the messages); the expected case none. Inside the system prefix, the system
messages' text (found in the rendered prompt) tells system from tools, wherever a template puts
the tools (Qwen3.5's before the system text); without it, what lies past the system text rendered
without tools counts as tools.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..protocol.chat_types import ChatMessage, ChatTool
from ..protocol.report import Divergence, ReuseReport
from .slot_leases import common_prefix

Render = Callable[[Sequence[ChatMessage], Sequence[ChatTool] | None], list[int]]


def left_at(report: ReuseReport, n_prompt: int) -> int | None:
    """Where the prompt left the state it was compared with (`slotkeeper.prefix` of the report),
    or None: no such state, or the prompt repeats all of it."""
    prefix = report.get("prefix")
    if not prefix:
        return None
    common, held = int(prefix["common"]), int(prefix["tokens"])
    return common if common < held and common < n_prompt else None


def in_last_turn(report: ReuseReport, at: int, slack: int) -> bool:
    """Whether a divergence at `at` lies in the compared state's last reply or in the generation
    prompt before it (`slack` tokens: the next turn renders the reply there, Qwen3.5 without the
    `<think>` it opened), known from the prompt it last served without rendering anything."""
    served = int(report["prefix"].get("prompt_tokens", 0))
    return served > 0 and at >= served - slack


def locate(
    render: Render,
    messages: Sequence[ChatMessage],
    tools: Sequence[ChatTool] | None,
    prompt: Sequence[int],
    at: int,
    system_spans: Sequence[tuple[int, int]] = (),
) -> Divergence:
    """The part of the conversation token `at` of `prompt` belongs to. `render(messages, tools)`
    tokenizes a conversation rendered without the generation prompt; `system_spans` are where the
    system messages' text lies in `prompt`, in tokens, when the caller found it (then a divergence
    in the system prefix outside them is in the tools, wherever the template puts those)."""

    def boundary(k: int, with_tools: bool = True) -> int:
        return common_prefix(render(messages[:k], tools if with_tools else None), prompt)

    n_system = 0
    while n_system < len(messages) and messages[n_system].get("role") in ("system", "developer"):
        n_system += 1
    lo, hi = 0, len(messages)  # message k spans [boundary(k), boundary(k + 1))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if boundary(mid) <= at:
            lo = mid
        else:
            hi = mid - 1
    if lo >= len(messages):
        return {"at": at, "part": "generation_prompt"}
    if lo < n_system or (lo == 0 and tools and at < boundary(0)):
        if system_spans:
            in_tools = not any(a <= at < b for a, b in system_spans)
        else:
            in_tools = n_system == 0 or at >= boundary(n_system, with_tools=False)
        return {"at": at, "part": "tools" if tools and in_tools else "system"}
    return {"at": at, "part": "message", "message": lo, "role": str(messages[lo].get("role", ""))}


def last_reply(messages: Sequence[ChatMessage], at: int) -> Divergence:
    """The expected case: the prompt left the state in (or right before) its last reply."""
    index = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=None)
    out: Divergence = {"at": at, "part": "reply"}
    if index is not None:
        out["message"] = index
    return out
