"""Chat formats per model family: how tool calls are written, read and forced, and where reasoning goes.

One module per family — `hermes` (JSON in `<tool_call>`: Qwen2.5/Qwen3, Hermes, Granite 4.0),
`qwen_xml` (`<function=…><parameter=…>`: Qwen3.5/3.6, Qwen3-Next, Qwen3-Coder, Nemotron-3),
`lfm2` (Python calls in `<|tool_call_start|>`: LFM2/LFM2.5), `nemotron_h` (a JSON list in
`<TOOLCALL>`: Nemotron-H / Nemotron Nano v2) — each with a block parser and a
forced-call grammar; `reasoning` splits `<think>` blocks; `output` chains the two over a
generation; `history` gives the template a conversation in the one shape it expects. `FORMATS` is the table
`--chat-format` picks from; under `auto` the template's text decides (`select_format`). A template with
a tool syntax none of them reads goes to llama.cpp's chat layer (`upstream`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from engine_pool.errors import ServerError

from ...protocol.chat_types import ChatTool
from ..grammar import CallRule, GrammarLimits, calls_grammar
from . import hermes, lfm2, nemotron_h, qwen_xml
from .calls import CallStream, ToolCall
from .output import ChatMessage, ChatOutput, Piece, assemble
from .reasoning import Reasoning, opened_by
from .upstream import NAME as UPSTREAM

__all__ = [
    "CHAT_FORMATS",
    "FORMATS",
    "UPSTREAM",
    "ChatFormat",
    "ChatMessage",
    "ChatOutput",
    "Piece",
    "Reasoning",
    "ToolCall",
    "assemble",
    "opened_by",
    "select_format",
]


@dataclass(frozen=True)
class ChatFormat:
    """One family's tool-call format."""

    name: str
    open: str  # the tag opening a call block (tool_choice none bans it when it is one token)
    close: str
    parse_block: Callable[[str, Mapping[str, Any]], list[ToolCall] | None]  # (block, schemas by tool)
    call_grammar: CallRule
    # Under `auto`, a template containing all the texts of one of these groups uses this format.
    markers: tuple[tuple[str, ...], ...]
    # Past calls ((name, arguments) pairs) as text, for a template without a syntax for them.
    write_calls: Callable[[Sequence[tuple[str, Any]]], str]

    def stream(self, tools: Sequence[ChatTool]) -> CallStream:
        """A stream reading this format's calls of `tools` (OpenAI tool objects) from text."""
        schemas = {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools}
        return CallStream(self.open, self.close, lambda block: self.parse_block(block, schemas))

    def grammar(
        self,
        tools: Sequence[tuple[str, Any]],
        limits: GrammarLimits | None = None,
        *,
        reasoning: bool = False,
        repeated: bool = False,
        lenient: Callable[[Any], Any] | None = None,
    ) -> str:
        """GBNF forcing exactly one call of one of `tools` ((name, parameters) pairs), after the end
        of the reasoning block the prompt opened when `reasoning` (`repeated`, `lenient`:
        `grammar.calls_grammar`)."""
        return calls_grammar(
            tools, self.call_grammar, limits, reasoning=reasoning, repeated=repeated, lenient=lenient
        )


# In detection order; the last one has no markers and is the default. Under `auto`, llama.cpp's chat
# layer reads a template's output instead when it does not read a call written in the detected
# format (formats.upstream).
FORMATS: dict[str, ChatFormat] = {
    "qwen-xml": ChatFormat(
        "qwen-xml",
        qwen_xml.OPEN,
        qwen_xml.CLOSE,
        qwen_xml.parse_block,
        qwen_xml.call_grammar,
        ((qwen_xml.FUNCTION, qwen_xml.PARAMETER),),
        qwen_xml.write_calls,
    ),
    "lfm2": ChatFormat(
        "lfm2", lfm2.OPEN, lfm2.CLOSE, lfm2.parse_block, lfm2.call_grammar, lfm2.MARKERS, lfm2.write_calls
    ),
    "nemotron-h": ChatFormat(
        "nemotron-h",
        nemotron_h.OPEN,
        nemotron_h.CLOSE,
        nemotron_h.parse_block,
        nemotron_h.call_grammar,
        nemotron_h.MARKERS,
        nemotron_h.write_calls,
    ),
    "hermes": ChatFormat(
        "hermes",
        hermes.OPEN,
        hermes.CLOSE,
        hermes.parse_block,
        hermes.call_grammar,
        ((),),
        hermes.write_calls,
    ),
}


# `--chat-format`: auto, one of FORMATS, or llama.cpp's chat layer (formats.upstream) for every
# template none of FORMATS reads.
CHAT_FORMATS = ("auto", *FORMATS, UPSTREAM)


def select_format(setting: str, template_source: str) -> ChatFormat:
    """The format `--chat-format` names, or under `auto` (and `llama.cpp`, where it only writes past
    calls for a template without a syntax for them) the first whose markers the template holds."""
    if setting in FORMATS:
        return FORMATS[setting]
    if setting not in CHAT_FORMATS:
        raise ServerError(
            f"--chat-format {setting!r} is not a chat format of this engine: {', '.join(CHAT_FORMATS)}"
        )
    return next(f for f in FORMATS.values() if any(all(m in template_source for m in g) for g in f.markers))
