"""llama-server's server flags on real engine processes (issue 10): aliases and tags, several listen
addresses (TCP and a UNIX socket), --no-slots, --metrics, CORS for browsers with and without
--api-key, -v, and the flags a llama-server command line may carry."""

from __future__ import annotations

import json
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest

from ..conftest import ENGINE_COMMAND, REPO, EngineProcess, run_engine

KEY = "sk-flags-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
ORIGIN = "https://app.example"
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}


def events(eng: EngineProcess) -> list[dict]:
    """The engine's JSON log events (llama.cpp's own lines in the same file are text)."""
    out = []
    for line in eng.log().splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def logged(eng: EngineProcess, what: Callable[[dict], bool], timeout_s: float = 10.0) -> list[dict]:
    """The events `what` accepts, waited for: a request's last events follow its response."""
    deadline = time.monotonic() + timeout_s
    while not (found := [e for e in events(eng) if what(e)]):
        assert time.monotonic() < deadline, f"no such event in the log:\n{eng.log()[-3000:]}"
        time.sleep(0.05)
    return found


def preflight(origin: str) -> dict[str, str]:
    """What a browser sends before a cross-origin POST with a key and a JSON body."""
    return {
        "Origin": origin,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type",
    }


@pytest.fixture(scope="module")
def sock_path() -> Iterator[Path]:
    # A short directory: a UNIX socket path has at most 107 bytes, pytest's tmp paths can be longer.
    with tempfile.TemporaryDirectory(prefix="sk-") as d:
        yield Path(d) / "engine.sock"


@pytest.fixture(scope="module")
def locked(
    models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory, sock_path: Path
) -> Iterator[EngineProcess]:
    """Aliases and tags, --no-slots, no --metrics, a key, two origins, -v, three listen addresses."""
    yield from run_engine(
        tmp_path_factory,
        models["qwen35"],
        *("-a", "first,second,third", "--tags", "chat,small", "--no-slots", "--api-key", KEY),
        *("--cors-origins", f"{ORIGIN},localhost", "-v", "--offline"),
        *("--host", f"127.0.0.1,127.0.0.2,{sock_path}"),
    )
    assert not sock_path.exists()  # the engine removes its UNIX socket on the way out


@pytest.fixture(scope="module")
def open_engine(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    """llama-server's defaults (slots on, CORS for any origin) plus --metrics and the model/KV flags
    (a llama model: --context-shift is refused for hybrid ones, whose recurrent state cannot shift)."""
    yield from run_engine(
        tmp_path_factory,
        models["llama"],
        *("--metrics", "-kvu", "--no-mmap", "--no-warmup", "--context-shift", "-ctk", "f16", "-ctv", "f16"),
    )


# -- --alias, --tags -------------------------------------------------------------------------------
def test_every_alias_is_listed_and_usable_as_the_model_name(locked: EngineProcess) -> None:
    listed = httpx.get(f"{locked.url}/v1/models").json()["data"]  # public, as in llama-server
    assert [m["id"] for m in listed] == ["first"]
    assert listed[0]["aliases"] == ["first", "second", "third"] and listed[0]["tags"] == ["chat", "small"]
    assert httpx.get(f"{locked.url}/props", headers=AUTH).json()["model_alias"] == "first"

    with openai.OpenAI(base_url=f"{locked.url}/v1", api_key=KEY, max_retries=0) as client:
        (model,) = client.models.list().data
        assert model.id == "first" and model.model_dump()["aliases"] == ["first", "second", "third"]
        for name in ("first", "second", "third"):
            r = client.chat.completions.create(
                model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0
            )
            assert r.choices[0].finish_reason in ("length", "stop") and r.usage is not None


# -- --no-slots, --metrics -------------------------------------------------------------------------
def test_no_slots_turns_the_slot_endpoints_off(locked: EngineProcess) -> None:
    with httpx.Client(base_url=locked.url, headers=AUTH, timeout=30) as c:
        for r in (c.get("/slots"), c.post("/slots/0?action=erase"), c.post("/slots/0?action=save", json={})):
            assert r.status_code == 501, r.text
            err = r.json()["error"]
            assert err["type"] == "not_supported_error"
            assert err["message"] == "This server does not support slots endpoint. Start it with `--slots`"
        props = c.get("/props").json()
        assert (props["endpoint_slots"], props["endpoint_metrics"]) == (False, False)


def test_metrics_answer_501_without_the_flag(locked: EngineProcess) -> None:
    r = httpx.get(f"{locked.url}/metrics", headers=AUTH)
    assert r.status_code == 501
    assert r.json()["error"]["message"] == (
        "This server does not support metrics endpoint. Start it with `--metrics`"
    )


def test_metrics_with_the_flag_include_the_process_start_time(open_engine: EngineProcess) -> None:
    with httpx.Client(base_url=open_engine.url, timeout=30) as c:
        text = c.get("/metrics").text
        started = float(
            next(ln for ln in text.splitlines() if ln.startswith("process_start_time_seconds ")).split()[1]
        )
        assert time.time() - 600 < started <= time.time()
        assert "slotkeeper_engine_ready 1.0" in text and "process_resident_memory_bytes" in text
        props = c.get("/props").json()
        assert (props["endpoint_slots"], props["endpoint_metrics"]) == (True, True)
        assert props["slotkeeper"]["aliases"] == [] and c.get("/slots").status_code == 200


# -- --host a,b,path.sock --------------------------------------------------------------------------
def test_every_address_answers(locked: EngineProcess, sock_path: Path) -> None:
    for host in ("127.0.0.1", "127.0.0.2"):
        assert httpx.get(f"http://{host}:{locked.port}/health").status_code == 200
        assert (
            httpx.post(
                f"http://{host}:{locked.port}/completion", json={"prompt": "a", "n_predict": 1}
            ).status_code
            == 401
        )
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock_path)), base_url="http://engine") as c:
        assert c.get("/health").status_code == 200
        r = c.post("/v1/chat/completions", json={"model": "third", **CHAT}, headers=AUTH, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"
    (listening,) = [e for e in events(locked) if e.get("event") == "engine.listening"]
    assert listening["addresses"] == [
        f"http://127.0.0.1:{locked.port}",
        f"http://127.0.0.2:{locked.port}",
        f"unix://{sock_path}",
    ]


def test_an_address_in_use_ends_the_engine_with_1(models: dict[str, Path], tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        cmd = [*ENGINE_COMMAND, "-m", str(models["qwen35"]), "--port", str(port)]
        run = subprocess.run(cmd, cwd=REPO, capture_output=True, timeout=60)
    assert run.returncode == 1, run.stderr.decode()[-2000:]
    assert f"cannot listen on 127.0.0.1 (port {port})" in (run.stdout + run.stderr).decode()


# -- CORS ------------------------------------------------------------------------------------------
def test_a_browser_preflight_needs_no_key(locked: EngineProcess) -> None:
    with httpx.Client(base_url=locked.url, timeout=60) as c:
        for path in ("/v1/chat/completions", "/completion", "/v1/messages"):
            r = c.options(path, headers=preflight(ORIGIN))
            assert r.status_code == 200, (path, r.status_code, r.text)
            assert r.headers["access-control-allow-origin"] == ORIGIN
            assert "POST" in r.headers["access-control-allow-methods"]
            assert r.headers["access-control-allow-headers"] == "*"  # llama-server's --cors-headers default
            assert r.headers["access-control-allow-credentials"] == "true"
        # The request that follows, and a refusal, both carry the header (so the page can read them).
        ok = c.post("/v1/chat/completions", json=CHAT, headers={"Origin": ORIGIN, **AUTH})
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ORIGIN
        refused = c.post("/v1/chat/completions", json=CHAT, headers={"Origin": ORIGIN})
        assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == ORIGIN
        # `localhost` admits the pages of this machine, on any port.
        local = c.options("/v1/chat/completions", headers=preflight("http://localhost:5173"))
        assert (
            local.status_code == 200
            and local.headers["access-control-allow-origin"] == "http://localhost:5173"
        )


def test_an_origin_not_listed_is_not_echoed(locked: EngineProcess) -> None:
    with httpx.Client(base_url=locked.url, timeout=30) as c:
        for origin in ("https://evil.example", "http://localhost.evil.example", "null"):
            r = c.options("/v1/chat/completions", headers=preflight(origin))  # answered, as llama-server
            assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
            plain = c.get("/v1/models", headers={"Origin": origin})
            assert plain.status_code == 200 and "access-control-allow-origin" not in plain.headers


def test_by_default_any_origin_is_allowed(open_engine: EngineProcess) -> None:
    with httpx.Client(base_url=open_engine.url, timeout=30) as c:
        r = c.options("/v1/chat/completions", headers=preflight("https://anything.example"))
        assert r.status_code == 200
        # llama-server's default allows credentials, so the origin is echoed rather than `*`.
        assert r.headers["access-control-allow-origin"] == "https://anything.example"
        assert c.get("/health", headers={"Origin": "https://x.example"}).headers[
            "access-control-allow-origin"
        ] == ("https://x.example")
        assert "access-control-allow-origin" not in c.get("/health").headers  # no Origin: not a browser


# -- -v, and the flags that are accepted -----------------------------------------------------------
def test_verbose_logs_debug_and_the_bodies(locked: EngineProcess) -> None:
    marker = "verbose-marker-7731"
    body = {"prompt": marker, "n_predict": 2}
    assert httpx.post(f"{locked.url}/completion", json=body, headers=AUTH, timeout=60).status_code == 200
    (body_event,) = logged(locked, lambda e: e.get("event") == "http.body" and marker in e["request"])
    assert body_event["level"] == "debug" and '"content"' in body_event["response"]


def test_model_and_cache_flags_are_accepted(open_engine: EngineProcess) -> None:
    s = next(e for e in events(open_engine) if e.get("event") == "engine.starting")["settings"]
    assert (s["kv_unified"], s["no_mmap"], s["no_warmup"], s["context_shift"]) == (True, True, True, True)
    assert (s["cache_type_k"], s["cache_type_v"], s["metrics"]) == ("f16", "f16", True)
    r = httpx.post(f"{open_engine.url}/v1/chat/completions", json=CHAT, timeout=60)
    assert r.status_code == 200
