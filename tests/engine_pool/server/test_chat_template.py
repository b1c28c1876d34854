"""engine_pool/server/chat_template.py: the GGUF template in a sandbox, its message boundaries in tokens."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import native
from engine_pool.errors import BadRequest
from engine_pool.server.chat_template import ChatTemplate, boundary_cuts
from native.model_gen import CHAT_TEMPLATE, write_model

TOOLS = [
    {"type": "function", "function": {"name": "f", "description": "<&>", "parameters": {"type": "object"}}}
]
SYSTEM = {"role": "system", "content": "You are terse."}


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[native.Engine]:
    path = Path(tmp_path_factory.mktemp("tpl")) / "llama.gguf"
    write_model(path, "llama", size="tiny", seed=0)
    eng = native.Engine(native.EngineConfig(str(path), n_slots=1, n_ctx=512, n_threads=1))
    yield eng
    eng.close()


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
    head = tok(template.render(messages[:1], TOOLS, add_generation_prompt=False), True)
    before_last = tok(template.render(messages[:3], TOOLS, add_generation_prompt=False), True)
    assert p.hints == [len(head), len(before_last)]
    assert p.tokens[: len(head)] == head and p.tokens[: len(before_last)] == before_last


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
