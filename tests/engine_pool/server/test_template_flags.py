"""--chat-template / --chat-template-file with llama-server's meanings, and the ChatML fallback.

The choice itself is pure (`template_override`, `select_template`); the engine processes show the
whole path: the chosen template renders the requests, its origin is one log event, and a template
the flags ask for that cannot be used stops the engine before the model loads (exit 1, the reason
in its last log event and never a healthy /health).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine_pool.server.builtin_templates import BUILTIN_TEMPLATES, CHATML
from engine_pool.server.chat_template import (
    ChatTemplate,
    TemplateChoice,
    TemplateConfigError,
    select_template,
    template_override,
)
from native.model_gen import CHAT_TEMPLATE

from ..conftest import EngineProcess

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "hello"},
    {"role": "assistant", "content": "hi"},
    {"role": "user", "content": "again"},
]
CUSTOM = (
    "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}[a] {% endif %}"
)


def events(log: str) -> list[dict[str, Any]]:
    out = []
    for line in log.splitlines():
        if line.startswith("{"):
            out.append(json.loads(line))
    return out


# -- the choice ---------------------------------------------------------------------------------
def test_no_flag_asks_for_nothing() -> None:
    assert template_override(None, None) is None
    assert template_override("", "") is None


@pytest.mark.parametrize("name", sorted(BUILTIN_TEMPLATES))
def test_builtin_names(name: str) -> None:
    choice = template_override(name, None)
    assert choice == TemplateChoice(BUILTIN_TEMPLATES[name], f"builtin:{name}")


def test_builtin_renderings() -> None:
    def render(name: str) -> str:
        return ChatTemplate(BUILTIN_TEMPLATES[name], "<bos>", "</s>").render(MESSAGES)

    assert render("chatml") == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhello<|im_end|>\n"
        "<|im_start|>assistant\nhi<|im_end|>\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n"
    )
    assert render("gemma") == (
        "<bos><start_of_turn>user\nBe brief.\n\nhello<end_of_turn>\n<start_of_turn>model\nhi<end_of_turn>\n"
        "<start_of_turn>user\nagain<end_of_turn>\n<start_of_turn>model\n"
    )
    assert render("llama3") == (
        "<bos><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nhello<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nhi<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nagain<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert render("mistral-v7") == (
        "<bos>[SYSTEM_PROMPT] Be brief.[/SYSTEM_PROMPT][INST] hello[/INST] hi</s>[INST] again[/INST]"
    )
    # llama-server's `command-r` (test_chat_completion.py::test_apply_chat_template): no BOS text
    assert render("command-r") == (
        "<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>Be brief.<|END_OF_TURN_TOKEN|>"
        "<|START_OF_TURN_TOKEN|><|USER_TOKEN|>hello<|END_OF_TURN_TOKEN|>"
        "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>hi<|END_OF_TURN_TOKEN|>"
        "<|START_OF_TURN_TOKEN|><|USER_TOKEN|>again<|END_OF_TURN_TOKEN|>"
        "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>"
    )


def test_only_chatml_renders_tools() -> None:
    tools: list[dict[str, Any]] = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    calls = [{"type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]
    convo: list[dict[str, Any]] = [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "content": "42"},
    ]
    text = ChatTemplate(CHATML).render(convo, tools)
    assert '<tools>\n{"type": "function", "function": {"name": "f"' in text
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call><|im_end|>'
        in text
    )
    assert (
        "<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n" in text
    )
    for name in ("gemma", "llama3", "mistral-v7", "command-r"):
        with pytest.raises(Exception, match=f"built-in '{name}' chat template has no tool-call format"):
            ChatTemplate(BUILTIN_TEMPLATES[name]).render(convo, tools)


def test_inline_jinja() -> None:
    assert template_override(CUSTOM, None) == TemplateChoice(CUSTOM, "inline")


def test_the_file_wins_over_the_name_and_the_inline_template(tmp_path: Path) -> None:
    f = tmp_path / "t.jinja"
    f.write_text(CUSTOM)
    assert template_override("gemma", str(f)) == TemplateChoice(CUSTOM, f"file:{f}")
    assert template_override("{{ 'x' }}", str(f)) == TemplateChoice(CUSTOM, f"file:{f}")


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (
            "gemma3",
            r"--chat-template 'gemma3' is neither a built-in template \(chatml, command-r, gemma, "
            r"llama3, mistral-v7\) nor a jinja template",
        ),
        ("{% for m in messages %}", r"--chat-template: the chat template does not compile: line 1: "),
        ("{{ messages[0].content.upper( }}", "does not compile"),
        ("{{ raise_exception('no user here') }}", "cannot render a one-message conversation: .*no user here"),
    ],
)
def test_unusable_flag_values(value: str, message: str) -> None:
    with pytest.raises(TemplateConfigError, match=message):
        template_override(value, None)


def test_unusable_files(tmp_path: Path) -> None:
    missing = tmp_path / "missing.jinja"
    with pytest.raises(TemplateConfigError, match=f"'{missing}' cannot be read: No such file or directory"):
        template_override(None, str(missing))
    with pytest.raises(TemplateConfigError, match="cannot be read: Is a directory"):
        template_override(None, str(tmp_path))
    binary = tmp_path / "binary.jinja"
    binary.write_bytes(b"\xff\xfe{{ x }}")
    with pytest.raises(TemplateConfigError, match="cannot be read: 'utf-8' codec can't decode"):
        template_override(None, str(binary))
    empty = tmp_path / "empty.jinja"
    empty.write_text("  \n")
    with pytest.raises(TemplateConfigError, match="is empty"):
        template_override(None, str(empty))
    broken = tmp_path / "broken.jinja"
    broken.write_text("line one\n{% if %}")
    with pytest.raises(
        TemplateConfigError, match=f"--chat-template-file '{broken}': .*does not compile: line 2"
    ):
        template_override("chatml", str(broken))  # the file wins even when it is the broken one


def test_select_falls_back_to_chatml() -> None:
    assert select_template(None, CHAT_TEMPLATE) == TemplateChoice(CHAT_TEMPLATE, "gguf")
    assert select_template(None, "") == TemplateChoice(
        CHATML, "chatml-fallback", "the model has no chat template"
    )
    broken = select_template(None, "{% for %}")
    assert (broken.source, broken.origin) == (CHATML, "chatml-fallback")
    assert broken.fallback_reason.startswith(
        "the model's template is unusable: the chat template does not compile"
    )
    override = TemplateChoice(CUSTOM, "inline")
    assert select_template(override, CHAT_TEMPLATE) is override
    assert select_template(override, "") is override


# -- engine processes -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--chat-template", "chatml2"), "--chat-template 'chatml2' is neither a built-in template"),
        (("--chat-template", "{% if %}"), "--chat-template: the chat template does not compile"),
        (("--chat-template-file", "/nonexistent/t.jinja"), "'/nonexistent/t.jinja' cannot be read"),
    ],
)
def test_the_engine_refuses_to_start(
    args: tuple[str, str], message: str, models: dict[str, Path], tmp_path: Path
) -> None:
    eng = EngineProcess(models["llama"], *args, log_path=tmp_path / "engine.log")
    with pytest.raises(RuntimeError, match="engine exited with 1"):
        eng.start()
    logged = events(eng.log())
    failed = [e for e in logged if e["event"] == "engine.load_failed"]
    assert len(failed) == 1 and message in failed[0]["error"], eng.log()
    assert failed[0]["error"].startswith("the chat template cannot be used: ")
    assert logged[-1]["event"] == "engine.exit" and logged[-1]["code"] == 1
    assert message in logged[-1]["reason"]
    assert not any(e["event"] == "engine.ready" for e in logged)  # refused before the model loaded


def _apply(c: httpx.Client, messages: list[dict[str, Any]]) -> str:
    r = c.post("/apply-template", json={"messages": messages})
    assert r.status_code == 200, r.text
    return str(r.json()["prompt"])


def test_flags_choose_what_the_engine_renders(models: dict[str, Path], tmp_path: Path) -> None:
    custom = tmp_path / "custom.jinja"
    custom.write_text(CUSTOM)
    builtin = BUILTIN_TEMPLATES
    runs = [
        ((), {}, "gguf", ChatTemplate(CHAT_TEMPLATE, "<s>", "</s>")),
        (("--chat-template", "gemma"), {}, "builtin:gemma", ChatTemplate(builtin["gemma"], "<s>", "</s>")),
        (
            (),
            {"SLOTKEEPER_CHAT_TEMPLATE": "llama3"},
            "builtin:llama3",
            ChatTemplate(builtin["llama3"], "<s>"),
        ),
        (
            ("--chat-template", "gemma", "--chat-template-file", str(custom)),
            {},
            f"file:{custom}",
            ChatTemplate(CUSTOM),
        ),
    ]
    for i, (args, env, origin, expected) in enumerate(runs):
        eng = EngineProcess(models["llama"], *args, log_path=tmp_path / f"engine{i}.log", env=env).start()
        try:
            with httpx.Client(base_url=eng.url, timeout=60) as c:
                assert _apply(c, MESSAGES) == expected.render(MESSAGES)
                r = c.post(
                    "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2, "temperature": 0}
                )
                assert r.status_code == 200, r.text
                assert r.json()["usage"]["prompt_tokens"] == len(
                    expected.tokenize(_tokenizer(c), expected.render(MESSAGES))
                )
        finally:
            assert eng.stop() == 0
        logged = events(eng.log())
        assert [e["origin"] for e in logged if e["event"] == "engine.chat_template"] == [origin]
        assert not any(e["event"] == "engine.chat_template_fallback" for e in logged)


def _retemplated(model: Path, out: Path, template: str | None) -> Path:
    """A copy of `model` whose `tokenizer.chat_template` is `template` (None: removed)."""
    args = (
        ["--remove-metadata", "tokenizer.chat_template"]
        if template is None
        else ["--chat-template", template]
    )
    cmd = [sys.executable, "-m", "gguf.scripts.gguf_new_metadata", str(model), str(out), *args, "--force"]
    subprocess.run(cmd, check=True, capture_output=True, stdin=subprocess.DEVNULL, timeout=60)
    return out


@pytest.mark.parametrize(
    ("template", "reason"),
    [
        (None, "the model has no chat template"),
        ("{% for %}", "the model's template is unusable: the chat template does not compile: line 1: "),
    ],
)
def test_a_model_without_a_usable_template_falls_back_to_chatml(
    template: str | None, reason: str, models: dict[str, Path], tmp_path: Path
) -> None:
    model = _retemplated(models["llama"], tmp_path / "model.gguf", template)
    eng = EngineProcess(model, log_path=tmp_path / "engine.log").start()
    try:
        with httpx.Client(base_url=eng.url, timeout=60) as c:
            assert _apply(c, MESSAGES) == ChatTemplate(CHATML).render(MESSAGES)
            r = c.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2, "temperature": 0})
            assert r.status_code == 200, r.text
    finally:
        assert eng.stop() == 0
    logged = events(eng.log())
    fallback = [e for e in logged if e["event"] == "engine.chat_template_fallback"]
    assert len(fallback) == 1 and fallback[0]["reason"].startswith(reason), fallback
    assert fallback[0]["level"] == "warning"
    assert [e["origin"] for e in logged if e["event"] == "engine.chat_template"] == ["chatml-fallback"]


def _tokenizer(c: httpx.Client) -> Any:
    def tokenize(text: str, add_special: bool) -> list[int]:
        r = c.post("/tokenize", json={"content": text, "add_special": add_special})
        assert r.status_code == 200, r.text
        return list(r.json()["tokens"])

    return tokenize
