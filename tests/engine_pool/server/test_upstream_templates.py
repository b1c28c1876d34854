"""tests/support/upstream_templates: llama-server renders a template file, and refuses as an outcome."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from support.upstream_templates import CONVERSATIONS, TOOLS, template_server

from gateway.bench.harness.upstream import binary

pytestmark = pytest.mark.skipif(
    binary() is None, reason="upstream llama-server is not installed (bench extra)"
)

CHATML_TOOLS = """{%- for m in messages -%}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endfor -%}
{%- if tools %}{{ tools | tojson }}{% endif -%}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif -%}"""


def test_renders_a_conversation_and_reports_a_refusal(tmp_path: Path, tiny_model: Callable[..., str]) -> None:
    template = tmp_path / "t.jinja"
    template.write_text(CHATML_TOOLS)
    refusing = tmp_path / "refusing.jinja"
    refusing.write_text(
        "{%- if messages[0].role != 'system' %}{{ raise_exception('a system message first') }}{% endif -%}"
        "{%- for m in messages %}{{ m.content }}{% endfor -%}"
    )
    messages, _ = CONVERSATIONS["d_plain_two_turns"]
    with template_server(template, Path(tiny_model("llama")), tmp_path / "a.log") as server:
        rendered = server.apply(messages, TOOLS)
        assert rendered.ok, rendered.text
        assert rendered.text.endswith("<|im_start|>assistant\n")
        assert "<|im_start|>user\nTell me a joke.<|im_end|>" in rendered.text
        assert '"get_weather"' in rendered.text
    with template_server(refusing, Path(tiny_model("llama")), tmp_path / "b.log") as server:
        refused = server.apply(messages)
        assert not refused.ok
        assert "a system message first" in refused.text
        assert refused.as_json() == {"ok": False, "error": refused.text}
