"""The chat template rendered with sandboxed jinja2, which template that is, and where its message
boundaries fall in tokens.

Which template (llama-server's rules, `select_template`): `--chat-template-file` wins over
`--chat-template` (a built-in name from `builtin_templates`, or an inline jinja template), which
wins over the GGUF's `tokenizer.chat_template`; a GGUF without a template, or with one that does not
compile, falls back to ChatML. A template given by flag that cannot be used — a name that is
neither built-in nor jinja, an unreadable file, a template that does not compile or cannot render a
one-message conversation — raises `TemplateConfigError`, and the engine refuses to start.

`ChatTemplate.prompt` renders a conversation, tokenizes it, and computes the checkpoint hints the
core should capture while prefilling:
- the end of the system/tools prefix (shared by every session of an agent);
- the start of the last user message (where another request of the same session may diverge; the
  core skips it when it lies less than `--checkpoint-min-step` after another checkpoint — a short
  reply after the previous turn's);
- the end of the history as the NEXT turn will re-render it. Templates render the generation
  prompt and a past assistant turn differently (Qwen3.5 opens `<think>` in the generation prompt
  and drops the reasoning from history), so the next turn leaves this prompt before its end, and
  the checkpoint at the prompt's end is past the divergence. The hint is where this prompt and the
  conversation continued by a placeholder assistant reply and user message first differ. (It is
  usually a few tokens before the prompt's end — two for Qwen3.5; the core keeps it, closer than
  `--checkpoint-min-step` as it is, and in place of a checkpoint at the prompt's end: an identical
  retry evaluates those few tokens, and each turn holds and saves one recurrent state fewer.)
A boundary is found by rendering (a prefix or a continuation of) the conversation on its own and
taking its common token prefix with the whole prompt, so it is right even where a template or the
tokenizer joins text across the boundary. A template that refuses a prefix on its own (Qwen3.5's
real template wants a user message) gets the prefix as two conversations continued by different
placeholder user messages render it in common: the boundary then lies after the next user
message's header, which any conversation sharing the prefix shares too.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property
from pathlib import Path

import jinja2

from engine_pool.errors import BadRequest

from ..protocol.chat_types import ChatMessage, ChatTool
from .builtin_templates import BUILTIN_TEMPLATES, CHATML, END_OF_TURN
from .formats import hermes
from .formats.history import TemplateMessage, WriteCalls, normalise
from .formats.reasoning import THINK_CLOSE, opened_by
from .jinja_env import environment
from .slot_leases import common_prefix
from .template_caps import TemplateCaps, detect

Tokenizer = Callable[[str, bool], list[int]]  # (text, add_special) -> tokens


@dataclass(frozen=True)
class ChatPrompt:
    """A rendered conversation: its text, its tokens and the checkpoint hints (token counts)."""

    text: str
    tokens: list[int]
    hints: list[int]


# Two placeholder replies that differ from their first character: wherever the template puts the
# content of the next turn's assistant message, at least one of them differs from this prompt there.
_PLACEHOLDERS = ("A", "B")


class ChatTemplate:
    """One compiled chat template with the model's special token texts.

    `origin` says where the source came from (`gguf`, `chatml-fallback`, `builtin:NAME`, `inline`,
    `file:PATH`), for the logs and /props. Every conversation is normalised first
    (`formats.history.normalise`, by the template's `caps`); `write_calls` writes past tool calls for
    a template that has no syntax for them (the engine's chat format).
    """

    def __init__(
        self,
        source: str,
        bos_token: str = "",
        eos_token: str = "",
        origin: str = "gguf",
        write_calls: WriteCalls = hermes.write_calls,
        reasoning: str = "auto",
    ) -> None:
        self.source = source
        self.reasoning = reasoning  # --reasoning: on | off | auto
        self.write_calls = write_calls
        # A chat generation stops on the end of its turn written as text (a built-in format's).
        self.stops: tuple[str, ...] = (END_OF_TURN[source],) if source in END_OF_TURN else ()
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.origin = origin
        try:
            self._template = environment().from_string(source) if source else None
        except jinja2.TemplateSyntaxError as exc:
            self._template = None
            self.error = f"the chat template does not compile: {_syntax_error(exc)}"
        else:
            self.error = "" if source else "the model has no chat template"

    def render(
        self,
        messages: Sequence[ChatMessage],
        tools: Sequence[ChatTool] | None = None,
        *,
        add_generation_prompt: bool = True,
        kwargs: Mapping[str, object] | None = None,
    ) -> str:
        if self._template is None:
            raise BadRequest(self.error)
        shaped = normalise(
            messages, tools, self.caps, developer_role=self.developer_role, write_calls=self.write_calls
        )
        # llama-server tells every template whether the model reasons (`enable_thinking`, unless the
        # request's chat_template_kwargs say otherwise); with --reasoning off a block the generation
        # prompt opens anyway is closed.
        thinking = self.reasoning != "off"
        variables = {"enable_thinking": thinking, **(kwargs or {})}
        text = self._render(shaped, tools, add_generation_prompt, variables)
        if add_generation_prompt and variables["enable_thinking"] is False and opened_by(text):
            text = f"{text.rstrip()}\n{THINK_CLOSE}"
        return text

    @cached_property
    def caps(self) -> TemplateCaps:
        """What the template can write (`template_caps`), found once by probe renders."""
        if self._template is None:
            return TemplateCaps()
        return detect(lambda messages, tools: self._render(messages, tools, True, None))

    @property
    def developer_role(self) -> bool:
        # Only gpt-oss's harmony templates (`<|channel|>`) know a developer role (llama.cpp's rule).
        return "<|channel|>" in self.source

    def _render(
        self,
        messages: Sequence[TemplateMessage | ChatMessage],  # normalised, or template_caps' probes
        tools: Sequence[ChatTool] | None,
        add_generation_prompt: bool,
        kwargs: Mapping[str, object] | None,
    ) -> str:
        assert self._template is not None
        today = datetime.now()
        variables: dict[str, object] = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "datetime": today.strftime("%b %d %Y"),  # llama.cpp's extra context
            "date_string": today.strftime("%d %b %Y"),
            **(kwargs or {}),
            "messages": list(messages),
            "add_generation_prompt": add_generation_prompt,
        }
        if tools:  # without tools the variable is undefined, as llama.cpp leaves it
            variables["tools"] = list(tools)
        try:
            return self._template.render(**variables)
        except jinja2.TemplateError as exc:
            raise BadRequest(f"the chat template refused the conversation: {exc}") from None
        except Exception as exc:  # noqa: BLE001 — whatever a template does with a conversation is a 400
            raise BadRequest(
                f"the chat template failed on the conversation: {type(exc).__name__}: {exc}"
            ) from None

    def prompt(
        self,
        tokenize: Tokenizer,
        messages: Sequence[ChatMessage],
        tools: Sequence[ChatTool] | None = None,
        kwargs: Mapping[str, object] | None = None,
    ) -> ChatPrompt:
        """Render, tokenize and place checkpoint hints at the message boundaries and where the next
        turn's re-rendered history will leave this prompt."""
        text = self.render(messages, tools, add_generation_prompt=True, kwargs=kwargs)
        tokens = self.tokenize(tokenize, text)
        hints: list[int] = []
        for cut in boundary_cuts(messages, bool(tools)):
            try:
                head = self.render(messages[:cut], tools, add_generation_prompt=False, kwargs=kwargs)
            except BadRequest:
                head = ""  # some templates refuse partial conversations (Qwen3.5: no user message)
            # For the shared prefix (system messages and tools: a short render) also what follows it
            # up to the next user message's text (its header, a date line), which every prompt
            # sharing the prefix shares too; for a later cut (most of a history) only when the
            # prefix alone cannot be rendered. The longer one this prompt starts with counts.
            ok = bool(head) and text.startswith(head)
            shared = all(m.get("role") in ("system", "developer") for m in messages[:cut])
            followed = self.followed_head(messages[:cut], tools, kwargs) if shared or not ok else ""
            heads = [h for h in (head, followed) if h and text.startswith(h)]
            if not heads:
                continue
            head = max(heads, key=len)
            n = common_prefix(self.tokenize(tokenize, head), tokens)
            if 0 < n < len(tokens):
                hints.append(n)
        end = self.next_turn_divergence(messages, tools, kwargs, text)
        if 0 < end < len(text):
            n = common_prefix(self.tokenize(tokenize, text[:end]), tokens)
            if 0 < n < len(tokens):
                hints.append(n)
        return ChatPrompt(text, tokens, sorted(set(hints)))

    def followed_head(
        self,
        messages: Sequence[ChatMessage],
        tools: Sequence[ChatTool] | None,
        kwargs: Mapping[str, object] | None,
    ) -> str:
        """What the template renders for `messages` before any user message that follows them:
        the common prefix of the conversation continued by two placeholder user messages (for a
        template that refuses to render `messages` alone, or renders them otherwise than inside a
        longer conversation). "" when it refuses those too."""
        texts = []
        for filler in _PLACEHOLDERS:
            following: list[ChatMessage] = [*messages, {"role": "user", "content": filler}]
            try:
                texts.append(self.render(following, tools, add_generation_prompt=False, kwargs=kwargs))
            except BadRequest:
                return ""
        return os.path.commonprefix(texts)

    def next_turn_divergence(
        self,
        messages: Sequence[ChatMessage],
        tools: Sequence[ChatTool] | None,
        kwargs: Mapping[str, object] | None,
        text: str,
    ) -> int:
        """Characters of `text` (this prompt) that the next turn's prompt will repeat.

        The next turn renders this conversation, the reply as an assistant message, and a new
        message. Rendering it with a placeholder reply and user message and taking the common prefix
        with `text` finds where it leaves this prompt: at the end for ChatML, before the `<think>`
        that a reasoning template's generation prompt opens, inside the last user message for a
        template that renders the last one differently. A template that refuses the placeholder
        continuation (roles out of order, a last message that is not the user's) gets the end of
        the conversation rendered without the generation prompt instead. 0: nothing found.
        """
        ends = []
        for filler in _PLACEHOLDERS:
            following: list[ChatMessage] = [
                {"role": "assistant", "content": filler},
                {"role": "user", "content": filler},
            ]
            try:
                nxt = self.render([*messages, *following], tools, add_generation_prompt=False, kwargs=kwargs)
            except BadRequest:
                break
            ends.append(len(os.path.commonprefix([text, nxt])))
        else:
            return min(ends)
        try:
            head = self.render(messages, tools, add_generation_prompt=False, kwargs=kwargs)
        except BadRequest:
            return 0
        return len(os.path.commonprefix([text, head]))

    def generation_prompt_tokens(self, tokenize: Tokenizer) -> int:
        """How many tokens the generation prompt adds to a conversation (0 when it cannot tell): a
        conversation that a turn re-renders leaves the prompt before it at most this far from its
        end (Qwen3.5's `<think>`), so a prompt leaving another's earlier is another conversation."""
        conversation: list[ChatMessage] = [{"role": "user", "content": "Hello"}]
        try:
            opened = self.tokenize(tokenize, self.render(conversation, add_generation_prompt=True))
            closed = self.tokenize(tokenize, self.render(conversation, add_generation_prompt=False))
        except BadRequest:
            return 0
        return len(opened) - common_prefix(opened, closed)

    def tokenize(self, tokenize: Tokenizer, text: str) -> list[int]:
        # A template that writes the BOS text itself must not get a second BOS from the tokenizer.
        add_special = not (self.bos_token and text.startswith(self.bos_token))
        return tokenize(text, add_special)


# -- which template ------------------------------------------------------------------------------
class TemplateConfigError(Exception):
    """A template given by flag cannot be used; the engine refuses to start with this message."""


@dataclass(frozen=True)
class TemplateChoice:
    """The template source the engine will use, where it came from, and why when it fell back."""

    source: str
    origin: str  # file:PATH | builtin:NAME | inline | gguf | chatml-fallback
    fallback_reason: str = ""


_SMOKE: list[ChatMessage] = [{"role": "user", "content": "Hello"}]


def _syntax_error(exc: jinja2.TemplateSyntaxError) -> str:
    return f"line {exc.lineno}: {exc.message}" if exc.lineno else str(exc.message)


def _unusable(source: str) -> str:
    """Why `source` cannot serve as a chat template ('' when it can): it must compile and render a
    one-message conversation (as llama-server renders an example at start-up)."""
    template = ChatTemplate(source, origin="check")
    if template.error:
        return template.error
    try:
        template.render(_SMOKE)
    except BadRequest as exc:
        return f"the chat template cannot render a one-message conversation: {exc.message}"
    return ""


def looks_like_jinja(value: str) -> bool:
    return "{{" in value or "{%" in value


def template_override(chat_template: str | None, chat_template_file: str | None) -> TemplateChoice | None:
    """The template the flags ask for, or None when they ask for none (then the GGUF's is used).

    `--chat-template-file` wins over `--chat-template`, as the more specific of the two. Raises
    TemplateConfigError, naming the flag, when the asked-for template cannot be used.
    """
    if chat_template_file:
        path = Path(chat_template_file)
        try:
            source = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise TemplateConfigError(
                f"--chat-template-file {chat_template_file!r} cannot be read: {why}"
            ) from None
        if not source.strip():
            raise TemplateConfigError(f"--chat-template-file {chat_template_file!r} is empty")
        choice = TemplateChoice(source, f"file:{path}")
        where = f"--chat-template-file {chat_template_file!r}"
    elif chat_template:
        if chat_template in BUILTIN_TEMPLATES:
            return TemplateChoice(BUILTIN_TEMPLATES[chat_template], f"builtin:{chat_template}")
        if not looks_like_jinja(chat_template):
            raise TemplateConfigError(
                f"--chat-template {chat_template!r} is neither a built-in template "
                f"({', '.join(sorted(BUILTIN_TEMPLATES))}) nor a jinja template"
            )
        choice = TemplateChoice(chat_template, "inline")
        where = "--chat-template"
    else:
        return None
    why = _unusable(choice.source)
    if why:
        raise TemplateConfigError(f"{where}: {why}")
    return choice


def select_template(override: TemplateChoice | None, gguf_template: str) -> TemplateChoice:
    """The template to use: the flags' (already checked), else the GGUF's, else ChatML — as
    llama-server falls back to ChatML for a model without a usable template."""
    if override is not None:
        return override
    if not gguf_template:
        return TemplateChoice(CHATML, "chatml-fallback", "the model has no chat template")
    why = _unusable(gguf_template)
    if why:
        return TemplateChoice(CHATML, "chatml-fallback", f"the model's template is unusable: {why}")
    return TemplateChoice(gguf_template, "gguf")


def boundary_cuts(messages: Sequence[ChatMessage], has_tools: bool) -> list[int]:
    """Message counts whose rendered prefix ends at a checkpoint-worthy boundary.

    - after the leading system message(s) — or before the first message when only tools form the
      system prefix;
    - before the last user message, when something precedes it beyond that prefix.
    """
    n_system = 0
    while n_system < len(messages) and messages[n_system].get("role") in ("system", "developer"):
        n_system += 1
    cuts = []
    if n_system or has_tools:
        cuts.append(n_system)
    last_user = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=-1)
    if last_user > n_system:
        cuts.append(last_user)
    return [c for c in cuts if 0 <= c < len(messages)] if messages else []
