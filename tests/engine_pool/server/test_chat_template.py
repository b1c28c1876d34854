"""engine_pool/server/chat_template.py: the template in a sandbox, its message boundaries in tokens, and
the hint where the next turn's re-rendered history leaves the prompt (unit, then on an engine)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import httpx
import pytest

import native
from engine_pool.errors import BadRequest
from engine_pool.server.builtin_templates import BUILTIN_TEMPLATES
from engine_pool.server.chat_template import ChatTemplate, boundary_cuts
from engine_pool.server.slot_leases import common_prefix
from native.model_gen import CHAT_TEMPLATE

from ..conftest import EngineProcess

TOOLS = [
    {"type": "function", "function": {"name": "f", "description": "<&>", "parameters": {"type": "object"}}}
]
SYSTEM = {"role": "system", "content": "You are terse."}


@pytest.fixture(scope="module")
def engine(tiny_model: Callable[..., str]) -> Iterator[native.Engine]:
    config = native.EngineConfig(tiny_model("llama"), n_slots=1, n_ctx=512, n_threads=1)
    with closing(native.Engine(config)) as eng:
        yield eng


@pytest.fixture
def template(engine: native.Engine) -> ChatTemplate:
    return ChatTemplate(engine.model.chat_template, "<s>", "</s>")


def test_the_gguf_carries_the_project_template(engine: native.Engine) -> None:
    assert engine.model.chat_template == CHAT_TEMPLATE


def test_render_chatml_with_tools_as_plain_json(template: ChatTemplate) -> None:
    text = template.render([SYSTEM, {"role": "user", "content": "hi"}], TOOLS)
    assert text.startswith("<|im_start|>system\nYou are terse.\n\n# Tools")
    assert '"description": "<&>"' in text  # tojson must not HTML-escape
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_boundary_cuts() -> None:
    user, asst = {"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}
    assert boundary_cuts([SYSTEM, user], False) == [1]
    assert boundary_cuts([user], True) == [0]
    assert boundary_cuts([user], False) == []
    assert boundary_cuts([SYSTEM, user, asst, user], False) == [1, 3]
    assert boundary_cuts([user, asst, user], False) == [2]


def test_hints_sit_at_the_system_prefix_end_and_the_last_user_start(
    template: ChatTemplate, engine: native.Engine
) -> None:
    def tok(text: str, add_special: bool) -> list[int]:
        return engine.tokenize(text, add_special, True)

    messages = [
        SYSTEM,
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "two"},
        {"role": "user", "content": "three"},
    ]
    p = template.prompt(tok, messages, TOOLS)
    assert p.tokens == tok(p.text, True)
    system = template.render(messages[:1], TOOLS, add_generation_prompt=False)
    # The shared prefix's hint: past the system prompt and tools, up to the next user message's
    # text (its header, which every conversation sharing the prefix renders too).
    followed = template.followed_head(messages[:1], TOOLS, None)
    assert followed.startswith(system) and followed.endswith("<|im_start|>user\n")
    shared = common_prefix(tok(followed, True), p.tokens)
    before_last = tok(template.render(messages[:3], TOOLS, add_generation_prompt=False), True)
    assert p.hints == [shared, len(before_last)]
    assert shared > len(tok(system, True)) and p.tokens[: len(before_last)] == before_last


def test_a_template_that_writes_bos_gets_no_second_one(engine: native.Engine) -> None:
    t = ChatTemplate("{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}", "<s>", "</s>")

    def tok(text: str, add_special: bool) -> list[int]:
        return engine.tokenize(text, add_special, True)

    p = t.prompt(tok, [{"role": "user", "content": "hello"}])
    assert p.tokens.count(engine.model.bos) == 1


def test_template_errors_are_bad_requests() -> None:
    t = ChatTemplate("{{ raise_exception('only user and assistant roles') }}")
    with pytest.raises(BadRequest, match="refused the conversation: only user and assistant roles"):
        t.render([{"role": "user", "content": "x"}])
    with pytest.raises(BadRequest, match="does not compile"):
        ChatTemplate("{% for %}").render([])
    with pytest.raises(BadRequest, match="no chat template"):
        ChatTemplate("").render([])


def test_the_sandbox_holds() -> None:
    t = ChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(BadRequest):
        t.render([{"role": "user", "content": "x"}])


# A reasoning template in the Qwen3.5 manner: the generation prompt opens `<think>`, and history
# renders an assistant turn without its reasoning.
THINKING = r"""{%- for message in messages -%}
    {%- if message.role == 'assistant' -%}
        {%- set content = message.content -%}
        {%- if '</think>' in content -%}
            {%- set content = content.split('</think>')[-1].lstrip('\n') -%}
        {%- endif -%}
        {{- '<|im_start|>assistant\n' + content + '<|im_end|>\n' -}}
    {%- else -%}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n<think>\n' -}}
{%- endif -%}
"""

# The same, refusing conversations whose roles do not alternate (as Gemma's and Mistral's do).
ALTERNATING = (
    "{%- for m in messages -%}{%- if (m.role == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{- raise_exception('roles must alternate user/assistant') -}}{%- endif -%}{%- endfor -%}" + THINKING
)


def test_hint_where_the_next_turn_leaves_a_thinking_prompt(engine: native.Engine) -> None:
    """The next turn re-renders the reply without `<think>`: it leaves this prompt right after
    `<|im_start|>assistant\\n`, and that is where the hint sits — not at the prompt's end, and not
    back at the start of the last user message."""

    def tok(text: str, add_special: bool) -> list[int]:
        return engine.tokenize(text, add_special, True)

    t = ChatTemplate(THINKING, "<s>", "</s>")
    turn1 = [SYSTEM, {"role": "user", "content": "one two three"}]
    p1 = t.prompt(tok, turn1)
    assert p1.text.endswith("<|im_start|>assistant\n<think>\n")
    up_to_reply = tok(p1.text[: -len("<think>\n")], True)
    assert p1.tokens[: len(up_to_reply)] == up_to_reply
    system_end = common_prefix(tok(t.followed_head(turn1[:1], None, None), True), p1.tokens)
    assert p1.hints == [system_end, len(up_to_reply)]
    assert len(up_to_reply) < len(p1.tokens)

    # What the model wrote, reasoning included, comes back as history without the reasoning.
    reply = {"role": "assistant", "content": "<think>\nlet me see\n</think>\n\nfour"}
    turn2 = [*turn1, reply, {"role": "user", "content": "five"}]
    p2 = t.prompt(tok, turn2)
    assert common_prefix(p2.tokens, p1.tokens) == len(up_to_reply)  # the next turn leaves exactly there
    last_user = len(tok(t.render(turn2[:3], add_generation_prompt=False), True))
    assert p2.hints == [system_end, last_user, len(p2.tokens) - len(tok("<think>\n", False))]


def test_a_template_refusing_the_placeholder_turn_gets_the_history_end(engine: native.Engine) -> None:
    """Continuing an assistant message: a placeholder reply after it breaks the alternation the
    template demands, so the hint falls back to the conversation rendered without the generation
    prompt."""

    def tok(text: str, add_special: bool) -> list[int]:
        return engine.tokenize(text, add_special, True)

    t = ChatTemplate(ALTERNATING, "<s>", "</s>")
    messages = [{"role": "user", "content": "one two"}, {"role": "assistant", "content": "three"}]
    with pytest.raises(BadRequest, match="alternate"):
        t.render([*messages, {"role": "assistant", "content": "x"}])
    p = t.prompt(tok, messages)
    history = tok(t.render(messages, add_generation_prompt=False), True)
    assert p.tokens[: len(history)] == history
    assert p.hints == [len(history)]


def test_chatml_needs_no_extra_hint(engine: native.Engine) -> None:
    """ChatML re-renders a reply right after its generation prompt: the prompt-end checkpoint serves
    the next turn, so no hint is added before it."""

    def tok(text: str, add_special: bool) -> list[int]:
        return engine.tokenize(text, add_special, True)

    t = ChatTemplate(BUILTIN_TEMPLATES["chatml"], "<s>", "</s>")
    messages = [{"role": "user", "content": "one"}]
    text = t.render(messages)
    assert t.next_turn_divergence(messages, None, None, text) == len(text)
    assert t.prompt(tok, messages).hints == []


def _post(c: httpx.Client, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = c.post(path, json=body)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def _tokens(c: httpx.Client, messages: list[dict[str, Any]], generation_prompt: bool = True) -> list[int]:
    text = _post(c, "/apply-template", {"messages": messages, "add_generation_prompt": generation_prompt})
    return list(_post(c, "/tokenize", {"content": text["prompt"], "add_special": True})["tokens"])


def _turn(c: httpx.Client, messages: list[dict[str, Any]]) -> dict[str, Any]:
    body = {"messages": messages, "id_slot": 0, "max_tokens": 8, "temperature": 0}
    return _post(c, "/v1/chat/completions", body)


def test_next_turn_on_a_hybrid_model_evaluates_only_the_reply_and_the_new_message(
    models: dict[str, Path], tmp_path: Path
) -> None:
    """A hybrid model (recurrent state: no trimming, only checkpoints) with a template that opens
    `<think>` in its generation prompt. The second turn rolls back to the hint where the re-rendered
    reply starts, live and after a save → SIGKILL → restart → restore, so it evaluates the reply and
    the new message only — not the whole last user message (the start-of-last-user checkpoint) or
    everything after the system prompt.

    The hint sits two tokens (`<think>`, `\\n`) before the prompt end, far closer than the default
    `--checkpoint-min-step`: the core spaces only its interval checkpoints, never hints. No interval
    checkpoints, so the hint is the only checkpoint that can serve."""
    template = tmp_path / "thinking.jinja"
    template.write_text(THINKING)
    args = (
        *("-np", "1", "-c", "2048"),
        *("--slot-save-path", str(tmp_path / "slots")),
        *("--chat-template-file", str(template)),
        *("--checkpoint-interval", "0"),
    )
    system = {"role": "system", "content": "You are a careful assistant who thinks first. " * 3}
    turn1 = [system, {"role": "user", "content": "What is the state of the slot cache after a restart?"}]

    first = EngineProcess(models["qwen35"], *args, log_path=tmp_path / "first.log").start()
    try:
        with httpx.Client(base_url=first.url, timeout=60) as c:
            r1 = _turn(c, turn1)
            assert _post(c, "/slots/0?action=save", {"filename": "turn1.slot"})["n_checkpoints"] >= 2
            # What a client sends back: the reply's content (reasoning, if it was split off, is dropped).
            reply = {"role": "assistant", "content": r1["choices"][0]["message"]["content"] or ""}
            turn2 = [*turn1, reply, {"role": "user", "content": "And after the next turn?"}]
            prompt1, prompt2 = _tokens(c, turn1), _tokens(c, turn2)
            history1 = _tokens(c, turn1, generation_prompt=False)
            system_end = len(_tokens(c, turn1[:1], generation_prompt=False))
            reply_start = len(prompt1) - len(_post(c, "/tokenize", {"content": "<think>\n"})["tokens"])
            live = _turn(c, turn2)
    finally:
        first.kill()

    assert r1["timings"]["prompt_n"] == len(prompt1)
    assert prompt2[:reply_start] == prompt1[:reply_start] and prompt2[reply_start] != prompt1[reply_start]
    bound = len(prompt2) - common_prefix(history1, prompt2)  # the re-rendered reply + the new message
    assert live["timings"]["cache_n"] == reply_start
    assert live["timings"]["prompt_n"] == len(prompt2) - reply_start <= bound
    assert live["timings"]["prompt_n"] < len(prompt2) - system_end  # what the checkpoints before gave

    second = EngineProcess(models["qwen35"], *args, log_path=tmp_path / "second.log").start()
    try:
        with httpx.Client(base_url=second.url, timeout=60) as c:
            _post(c, "/slots/0?action=restore", {"filename": "turn1.slot"})
            restored = _turn(c, turn2)
    finally:
        assert second.stop() == 0
    assert restored["slotkeeper"]["restored"] is True
    assert restored["timings"]["cache_n"] == reply_start
    assert restored["timings"]["prompt_n"] == live["timings"]["prompt_n"]
    assert restored["usage"]["prompt_tokens_details"]["cached_tokens"] == reply_start
    assert restored["choices"][0]["message"]["content"] == live["choices"][0]["message"]["content"]


def test_the_generation_prompt_length_is_measured_from_the_template() -> None:
    def chars(text: str, add_special: bool) -> list[int]:
        return [ord(c) for c in text]

    chatml = ChatTemplate(BUILTIN_TEMPLATES["chatml"])
    assert chatml.generation_prompt_tokens(chars) == len("<|im_start|>assistant\n")
    thinking = ChatTemplate(
        "{% for m in messages %}{{ m.content }};{% endfor %}"
        "{% if add_generation_prompt %}A:<think>\n{% endif %}"
    )
    assert thinking.generation_prompt_tokens(chars) == len("A:<think>\n")
    assert ChatTemplate("{{ raise_exception('no') }}").generation_prompt_tokens(chars) == 0


def test_a_template_refusing_a_system_only_prefix_still_hints_its_end(engine: native.Engine) -> None:
    """Qwen3.5's published template raises 'No user query found in messages.' for the system
    prompt alone: the shared prefix's hint comes from two placeholder continuations instead."""

    def tok(text: str, add_special: bool) -> list[int]:
        return engine.tokenize(text, add_special, True)

    refusing = ChatTemplate(
        "{% if not (messages | selectattr('role', 'equalto', 'user') | list) %}"
        "{{ raise_exception('No user query found in messages.') }}{% endif %}" + BUILTIN_TEMPLATES["chatml"]
    )
    messages = [SYSTEM, {"role": "user", "content": "Fix the build."}]
    with pytest.raises(BadRequest):
        refusing.render(messages[:1], add_generation_prompt=False)
    p = refusing.prompt(tok, messages)
    header = tok("<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\n", True)
    assert p.hints[0] == common_prefix(header, p.tokens) > 0
    other = refusing.prompt(tok, [SYSTEM, {"role": "user", "content": "Another task."}])
    assert other.tokens[: p.hints[0]] == p.tokens[: p.hints[0]]  # every such prompt shares it
