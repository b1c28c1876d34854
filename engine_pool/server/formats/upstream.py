"""llama.cpp's chat layer for the templates whose tool-call format has no module here.

The families we serve (hermes, qwen-xml, lfm2, nemotron-h) keep their own parsers: they keep every
character a model writes, where llama.cpp fails a request whose output leaves its grammar
(docs/chat-formats.md). Every other template with a tool-call syntax (Llama 3.x, Mistral, DeepSeek,
GLM, Kimi, gpt-oss, Command-R, functionary, ...) is read the way llama-server reads it: the vendored
`common/chat` (native.ChatLayer) derives the format, the parser and the tool-call grammar from the
template and the request, and native.ChatParser reads the output.

`UpstreamChat.plan` runs per request (the parser depends on the tools, the tool choice and the
generation prompt); `UpstreamOutput` reads the generation's text as it grows, like `ChatOutput`,
under our rule: a final output llama.cpp cannot read, or a call whose arguments are not a JSON
object, is returned as content, never an error after the generation ran.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypedDict

import structlog

import native

from ...protocol.chat_types import ChatMessage, ChatTool
from ..grammar import GrammarTriggers
from .calls import ToolCall, loads_json
from .output import Piece
from .reasoning import THINK_CLOSE, Reasoning, opened_by

if TYPE_CHECKING:
    from . import ChatFormat

log = structlog.get_logger("engine.chat_format")

NAME = "llama.cpp"  # the --chat-format name
CONTENT_ONLY = "Content-only"  # llama.cpp's name of the format of a template without tool syntax

# A probe conversation with one tool: the format llama.cpp gives it is the template's tool format.
_PROBE_MESSAGES: list[ChatMessage] = [{"role": "user", "content": "What is the weather in Paris?"}]
_PROBE_TOOLS: list[ChatTool] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]

_PROBE_CALL = ("get_weather", {"city": "Paris"})

# Partial parses re-read the whole output (llama-server parses after every token): past this many
# characters, parse again only once this many more have arrived, so that a long answer costs
# linear, not quadratic, time; the final parse always reads everything.
_PARSE_EVERY_FROM = 4096
_PARSE_STEP = 256

Tokenize = Callable[[str], list[int]]


class GrammarTrigger(TypedDict):
    """One of the plan's `grammar_triggers`, as native.ChatLayer writes it (native/src/chat.cpp)."""

    type: str  # word | pattern | pattern_full | token
    value: str
    token: int  # the trigger token (type token), else -1


class ParsedCall(TypedDict):
    name: str
    arguments: str  # a JSON text ("" when the model wrote none)
    id: str  # the id the model wrote, else ""


class ParsedMessage(TypedDict):
    """What native.ChatParser.parse reads from an output (native/src/chat.cpp)."""

    content: str
    reasoning_content: str
    tool_calls: list[ParsedCall]


@dataclass(frozen=True)
class UpstreamPlan:
    """What llama.cpp's chat layer derives for one request."""

    format: str
    parser: str
    generation_prompt: str
    grammar: str
    grammar_lazy: bool
    triggers: list[GrammarTrigger]
    preserved: tuple[str, ...]
    stops: tuple[str, ...]

    def reads(self, text: str, call: tuple[str, Any]) -> bool:
        """Whether this plan's parser reads `text` as exactly `call` ((name, arguments))."""
        parser = native.ChatParser(self.format, self.parser, self.generation_prompt, "auto", True)
        if opened_by(self.generation_prompt):  # a model closes the block the prompt opened first
            text = f"{THINK_CLOSE}\n\n{text}"
        try:
            msg: ParsedMessage = json.loads(parser.parse(text, False))
            calls = [(c["name"], loads_json(c["arguments"] or "{}")) for c in msg["tool_calls"]]
        except (native.InvalidRequestError, ValueError):
            return False
        return calls == [call]

    def grammar_triggers(self, tokenize: Tokenize, piece: Callable[[int], str]) -> GrammarTriggers:
        """The grammar's start as the core takes it, as llama-server derives it: a trigger word
        that is one preserved token triggers on that token, other words as escaped patterns,
        full patterns anchored; a grammar that is not lazy first accepts the generation prompt
        (less a leading space token some tokenizers put before it, as common_sampler_init does)."""
        if not self.grammar_lazy:
            ids = tokenize(self.generation_prompt)
            if ids and piece(ids[0])[:1].isspace() and not self.generation_prompt[:1].isspace():
                ids = ids[1:]
            return GrammarTriggers(prefill=tuple(ids))
        preserved = set()
        for text in self.preserved:
            ids = tokenize(text)
            if len(ids) == 1:
                preserved.add(ids[0])
        patterns: list[str] = []
        tokens: list[int] = []
        for t in self.triggers:
            kind, value = t["type"], t["value"]
            if kind == "word":
                ids = tokenize(value)
                if len(ids) == 1 and ids[0] in preserved:
                    tokens.append(ids[0])
                else:
                    patterns.append(re.escape(value))
            elif kind == "pattern_full":
                patterns.append(
                    ("" if value.startswith("^") else "^") + value + ("" if value.endswith("$") else "$")
                )
            elif kind == "token" and t["token"] >= 0:
                tokens.append(t["token"])
            else:
                patterns.append(value)
        return GrammarTriggers(lazy=True, patterns=tuple(patterns), tokens=tuple(tokens))


class UpstreamChat:
    """llama.cpp's chat layer over the engine's template."""

    def __init__(self, source: str, bos: str, eos: str) -> None:
        self._layer = native.ChatLayer(source, bos, eos)

    @classmethod
    def for_template(
        cls, source: str, bos: str, eos: str, ours: ChatFormat | None, writes_calls: bool = True
    ) -> UpstreamChat | None:
        """The layer when it should read this template's output: the template writes tool calls
        (`writes_calls`, our probe renders), llama.cpp finds a format for them, and it is not the
        engine's own format detected there (`ours`; None: always llama.cpp's): llama.cpp does not
        read a call written in ours (GLM's `<tool_call>` is not Hermes'). None otherwise: the
        engine's own format writes and reads calls for a template without a syntax for them, and
        reads its families' calls losing nothing."""
        if not writes_calls:
            return None
        try:
            chat = cls(source, bos, eos)
            plan = chat.plan(
                _PROBE_MESSAGES,
                _PROBE_TOOLS,
                "auto",
                enable_thinking=False,
                reasoning_format="auto",
                kwargs={},
            )
        except native.InvalidRequestError as exc:
            log.warning("engine.chat_layer_unusable", error=str(exc))
            return None
        if plan.format == CONTENT_ONLY:
            return None
        if ours is not None and plan.reads(ours.write_calls([_PROBE_CALL]), _PROBE_CALL):
            return None
        return chat

    def plan(
        self,
        messages: Sequence[ChatMessage],
        tools: Sequence[ChatTool],
        tool_choice: str,
        *,
        enable_thinking: bool,
        reasoning_format: str,
        kwargs: Mapping[str, object],  # the request's `chat_template_kwargs`
    ) -> UpstreamPlan:
        """The format, parser and grammar for a request (InvalidRequestError when llama.cpp refuses
        the conversation). `tool_choice`: auto | required | none."""
        request = {
            "messages": list(messages),
            "tools": list(tools),
            "tool_choice": tool_choice,
            "parallel_tool_calls": True,
            "enable_thinking": enable_thinking,
            "reasoning_format": reasoning_format,
            "chat_template_kwargs": dict(kwargs),
        }
        p = json.loads(self._layer.apply(json.dumps(request, ensure_ascii=False)))
        return UpstreamPlan(
            format=p["format"],
            parser=p["parser"],
            generation_prompt=p["generation_prompt"],
            grammar=p["grammar"],
            grammar_lazy=bool(p["grammar_lazy"]),
            triggers=list(p["grammar_triggers"]),
            preserved=tuple(p["preserved_tokens"]),
            stops=tuple(p["additional_stops"]),
        )


class UpstreamOutput:
    """Text deltas in; content strings, Reasoning and ToolCalls out, in order (`ChatOutput`'s
    interface), read by llama.cpp's parser for the plan's format.

    Content and reasoning go out as the partial parses grow them, calls at the end (the final parse
    checks them: llama.cpp's partial parses hold calls still being written).
    """

    def __init__(self, plan: UpstreamPlan, reasoning_format: str, parse_tool_calls: bool) -> None:
        self._parser = native.ChatParser(
            plan.format, plan.parser, plan.generation_prompt, reasoning_format, parse_tool_calls
        )
        self._text = ""
        self._parsed_at = 0
        self._content = ""  # sent so far
        self._reasoning = ""
        self._unread_tokens = 0  # fed since the last parse
        self.reasoning_tokens = 0

    def feed(self, text: str, n_tokens: int = 0) -> list[Piece]:
        self._text += text
        self._unread_tokens += n_tokens
        if len(self._text) >= _PARSE_EVERY_FROM and len(self._text) - self._parsed_at < _PARSE_STEP:
            return []
        self._parsed_at = len(self._text)
        try:
            msg: ParsedMessage = json.loads(self._parser.parse(self._text, True))
        except native.InvalidRequestError:
            return []  # not readable yet: the final parse decides
        out = self._grown(msg)
        if any(isinstance(p, Reasoning) for p in out):
            self.reasoning_tokens += self._unread_tokens  # the tokens that grew the reasoning
        self._unread_tokens = 0
        return out

    def finish(self) -> list[Piece]:
        try:
            msg: ParsedMessage = json.loads(self._parser.parse(self._text, False))
            calls = [_call(c) for c in msg["tool_calls"]]
        except (native.InvalidRequestError, ValueError) as exc:
            log.warning("engine.output_unparsed", error=str(exc), chars=len(self._text))
            return self._unparsed()
        return self._grown(msg, calls=calls)

    def _grown(self, msg: ParsedMessage, *, calls: list[ToolCall] | None = None) -> list[Piece]:
        """What the parse `msg` adds to what was sent; `calls` with the final parse."""
        final = calls is not None
        out: list[Piece] = []
        reasoning = _added(self._reasoning, msg["reasoning_content"], final)
        if reasoning:
            out.append(Reasoning(reasoning))
            self._reasoning = msg["reasoning_content"]
        content = _added(self._content, msg["content"], final)
        if content:
            out.append(content)
            self._content = msg["content"]
        return out + (calls or [])

    def _unparsed(self) -> list[Piece]:
        """The output as content, less the content already sent when that is where it begins
        (after reasoning went out, the whole text: repeated rather than lost)."""
        if not self._reasoning and self._text.startswith(self._content):
            rest = self._text[len(self._content) :]
            return [rest] if rest else []
        return [self._text]


def _call(raw: ParsedCall) -> ToolCall:
    """A parsed call, its arguments checked to be a JSON object (ValueError otherwise)."""
    args = loads_json(raw["arguments"] or "{}")
    if not isinstance(args, dict):
        raise ValueError(f"the arguments of {raw['name']!r} are not a JSON object")
    if raw.get("id"):  # the id the model wrote (Mistral's, Kimi's), as llama-server keeps it
        return ToolCall(raw["name"], raw["arguments"] or "{}", raw["id"])
    return ToolCall(raw["name"], raw["arguments"] or "{}")


def _added(sent: str, now: str, final: bool) -> str:
    """The text a parse adds to what was sent. A partial parse that reads the text otherwise than
    before adds nothing until it agrees again; the final parse adds what follows the common part,
    so that what was sent stands and nothing is lost."""
    if now.startswith(sent):
        return now[len(sent) :]
    return now[len(os.path.commonprefix([sent, now])) :] if final else ""
