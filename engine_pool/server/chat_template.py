"""The GGUF's chat template rendered with sandboxed jinja2, and where its message boundaries fall in tokens.

`ChatTemplate.prompt` renders a conversation, tokenizes it, and computes the checkpoint hints the
core should capture while prefilling: the end of the system/tools prefix (shared by every session
of an agent) and the start of the last user message (where the next turn of the same session
usually diverges). A boundary is found by rendering the conversation's prefix on its own and taking
its common token prefix with the whole prompt, so it is right even where a template or the
tokenizer joins text across the boundary.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..errors import BadRequest
from .scheduler import common_prefix

Tokenizer = Callable[[str, bool], list[int]]  # (text, add_special) -> tokens


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, **_: Any) -> str:
    # Like the HF/minja `tojson`: plain JSON, not jinja2's HTML-escaped Markup.
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@dataclass(frozen=True)
class ChatPrompt:
    """A rendered conversation: its text, its tokens and the checkpoint hints (token counts)."""

    text: str
    tokens: list[int]
    hints: list[int]


class ChatTemplate:
    """One compiled chat template with the model's special token texts."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "") -> None:
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source) if source else None
        except jinja2.TemplateSyntaxError as exc:
            self._template = None
            self.error = f"the model's chat template does not compile: {exc}"
        else:
            self.error = "" if source else "the model has no chat template"

    def render(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = True,
        kwargs: dict[str, Any] | None = None,
    ) -> str:
        if self._template is None:
            raise BadRequest(self.error)
        variables: dict[str, Any] = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            **(kwargs or {}),
            "messages": list(messages),
            "tools": list(tools) if tools else None,
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            return self._template.render(**variables)
        except jinja2.TemplateError as exc:
            raise BadRequest(f"the chat template refused the conversation: {exc}") from None
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            raise BadRequest(
                f"the chat template failed on the conversation: {type(exc).__name__}: {exc}"
            ) from None

    def prompt(
        self,
        tokenize: Tokenizer,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        kwargs: dict[str, Any] | None = None,
    ) -> ChatPrompt:
        """Render, tokenize and place checkpoint hints at the message boundaries."""
        text = self.render(messages, tools, add_generation_prompt=True, kwargs=kwargs)
        tokens = self.tokenize(tokenize, text)
        hints: list[int] = []
        for cut in boundary_cuts(messages, bool(tools)):
            try:
                head = self.render(messages[:cut], tools, add_generation_prompt=False, kwargs=kwargs)
            except BadRequest:
                continue  # some templates refuse partial conversations; the hint is only an optimisation
            if not head or not text.startswith(head):
                continue
            n = common_prefix(self.tokenize(tokenize, head), tokens)
            if 0 < n < len(tokens):
                hints.append(n)
        return ChatPrompt(text, tokens, sorted(set(hints)))

    def tokenize(self, tokenize: Tokenizer, text: str) -> list[int]:
        # A template that writes the BOS text itself must not get a second BOS from the tokenizer.
        add_special = not (self.bos_token and text.startswith(self.bos_token))
        return tokenize(text, add_special)


def boundary_cuts(messages: Sequence[dict[str, Any]], has_tools: bool) -> list[int]:
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
