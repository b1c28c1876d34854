"""engine_pool/server/settings.py and engine_flags.py: llama-server's flags, SLOTKEEPER_* variables,
one frozen object."""

from __future__ import annotations

import dataclasses

import pytest
from support.variables import slotkeeper_env

from engine_pool.http.body import BodyLimits
from engine_pool.server.engine_main import main
from engine_pool.server.grammar import GrammarLimits
from engine_pool.server.limits import RequestLimits
from engine_pool.server.settings import (
    CACHE_TYPES,
    FLAGS,
    SWITCHES_OFF,
    EngineSettings,
    SettingsError,
    parse_settings,
)


def test_llama_server_flags_keep_their_meaning() -> None:
    s = parse_settings(
        [
            "-m",
            "m.gguf",
            "--host",
            "0.0.0.0",
            "--port",
            "9000",
            "-np",
            "4",
            "-c",
            "8192",
            "-b",
            "1024",
            "-ub",
            "256",
            "-t",
            "-1",
            "-ngl",
            "99",
            "--seed",
            "7",
            "--temp",
            "0.2",
            "-a",
            "qwen",
            "--slot-save-path",
            "/tmp/s",
            "--ctx-checkpoints",
            "8",
            "--checkpoint-min-step",
            "16",
            "--api-key",
            "k",
            "--checkpoint-interval",
            "512",
            "--max-checkpoint-bytes",
            "64M",
            "--queue-size",
            "3",
            "-fa",
            "on",
            "--swa-full",
        ],
        {},
    )
    assert (s.model, s.host, s.port, s.n_slots, s.n_ctx, s.n_batch, s.n_ubatch) == (
        "m.gguf",
        "0.0.0.0",
        9000,
        4,
        8192,
        1024,
        256,
    )
    assert (s.n_threads, s.n_gpu_layers, s.seed, s.temperature, s.model_id) == (0, 99, 7, 0.2, "qwen")
    assert (s.slot_save_path, s.max_checkpoints, s.checkpoint_min_step, s.api_key) == ("/tmp/s", 8, 16, "k")
    assert (s.checkpoint_interval, s.max_checkpoint_bytes, s.queue_size) == (512, 64 << 20, 3)
    assert s.flash_attn and s.swa_full


def test_environment_fills_in_and_the_command_line_wins() -> None:
    env = slotkeeper_env(model="env.gguf", parallel="3", port="7000", swa_full="yes")
    s = parse_settings(["--port", "7001"], env)
    assert (s.model, s.n_slots, s.port, s.swa_full) == ("env.gguf", 3, 7001, True)
    assert parse_settings(["-m", "x"], {}).model_id == "x"


def test_settings_are_frozen() -> None:
    s = parse_settings(["-m", "x"], {})
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.port = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["-m", "x", "--bogus"], {}, "unrecognized arguments: --bogus"),
        ([], {}, "-m/--model is required (or set SLOTKEEPER_MODEL)"),
        (["-m", "x", "--port", "http"], {}, "--port: invalid value 'http'"),
        (["-m", "x"], {"SLOTKEEPER_PARALLEL": "many"}, "SLOTKEEPER_PARALLEL: invalid value 'many'"),
        (["-m", "x", "-np", "0"], {}, "--parallel must be within 1..256"),
        (["-m", "x", "--max-checkpoint-bytes", "lots"], {}, "--max-checkpoint-bytes: invalid value"),
        (["-m", "x", "-fa", "maybe"], {}, "--flash-attn: invalid value 'maybe'"),
        (["-m", "x", "--log-level", "loud"], {}, "--log-level must be"),
        (["-m", "x", "--max-grammar-depth", "5000"], {}, "--max-grammar-depth must be within 1..1024"),
        (["-m", "x"], {"SLOTKEEPER_MAX_SCHEMA_DEPTH": "0"}, "--max-schema-depth must be within 1..128"),
        (["-m", "x", "--max-body-bytes", "1"], {}, "--max-body-bytes must be >= 1024"),
        (["-m", "x", "--body-timeout-s", "0"], {}, "--body-timeout-s must be > 0"),
        (["-m", "x", "-ctk", "q8"], {}, "--cache-type-k: invalid value 'q8' (allowed values: f32, f16,"),
        (["-m", "x"], {"SLOTKEEPER_CACHE_TYPE_V": "Q8_0"}, "SLOTKEEPER_CACHE_TYPE_V: invalid value 'Q8_0'"),
        (["-m", "x", "--host", " , "], {}, "--host must be one or more addresses"),
        (["-m", "x", "--host", "a,b", "--port", "0"], {}, "--port 0 is not supported with multiple TCP"),
        (["-m", "x", "--cors-origins", ","], {}, "--cors-origins must be *, localhost or one or more"),
        (["-m", "x", "--metrics", "on"], {}, "unrecognized arguments: on"),
    ],
)
def test_bad_flags_and_variables_are_clear_errors(argv: list[str], env: dict[str, str], message: str) -> None:
    with pytest.raises(SettingsError) as exc:
        parse_settings(argv, env)
    assert message in str(exc.value)


def test_every_field_has_exactly_one_row() -> None:
    # predict_route has no flag: Vertex AI's AIP_* variables set it (vertex_values)
    fields = {f.name for f in dataclasses.fields(EngineSettings)} - {"predict_route"}
    rows = [f.field for f in FLAGS]
    assert sorted(rows) == sorted(fields)
    assert all(f.env.startswith("SLOTKEEPER_") for f in FLAGS)
    flags = [flag for f in FLAGS for flag in f.flags] + [flag for _, off in SWITCHES_OFF for flag in off]
    assert len(flags) == len(set(flags))
    switches = {f.field for f in FLAGS if f.switch}
    assert {field for field, _ in SWITCHES_OFF} <= switches  # only a switch can be turned off again


# The variables keep llama-server's names (LLAMA_ARG_CTX_SIZE → SLOTKEEPER_CTX_SIZE), not the fields'.
LLAMA_SERVER_VARIABLES = {
    "n_slots": "PARALLEL",
    "n_ctx": "CTX_SIZE",
    "n_batch": "BATCH_SIZE",
    "n_ubatch": "UBATCH_SIZE",
    "n_threads": "THREADS",
    "n_gpu_layers": "N_GPU_LAYERS",
    "temperature": "TEMP",
    "max_checkpoints": "CTX_CHECKPOINTS",
    "slot_wait_s": "SLOT_WAIT_TIMEOUT",
    "retry_after_s": "RETRY_AFTER",
    "shutdown_grace_s": "SHUTDOWN_GRACE",
    "verbose": "VERBOSE",
    "ui_mcp_proxy": "UI_MCP_PROXY",
}


def test_variables_keep_llama_servers_names() -> None:
    env = {f.field: f.env.removeprefix("SLOTKEEPER_") for f in FLAGS if f.field in LLAMA_SERVER_VARIABLES}
    assert env == LLAMA_SERVER_VARIABLES


def test_main_returns_2_on_bad_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["-m", "x", "--nope"]) == 2
    assert "slotkeeper engine: error: unrecognized arguments: --nope" in capsys.readouterr().err
    assert main(["--help"]) == 0
    assert "--slot-save-path" in capsys.readouterr().out


def test_request_limits_come_from_settings_once() -> None:
    default = RequestLimits.from_settings(parse_settings(["-m", "x", "-np", "3", "--queue-size", "5"], {}))
    # The defaults of the settings are the defaults of the limits (one source of truth each way).
    assert dataclasses.replace(default, n_slots=1, queue_size=16) == RequestLimits()
    assert default.max_prompts == 8
    assert (default.body, default.schema) == (
        BodyLimits(16 << 20, 64, 60.0),
        GrammarLimits(32, 2 << 20, 32768),
    )
    s = parse_settings(
        [
            "-m",
            "x",
            "--max-body-bytes",
            "1M",
            "--max-grammar-bytes",
            "8K",
            "--max-schema-grammar-rules",
            "99",
        ],
        {"SLOTKEEPER_MAX_TOOLS": "3", "SLOTKEEPER_BODY_TIMEOUT_S": "2.5", "SLOTKEEPER_MAX_TEXT_CHARS": "1M"},
    )
    lim = RequestLimits.from_settings(s)
    assert (lim.body.max_bytes, lim.body.read_timeout_s, lim.max_tools) == (1 << 20, 2.5, 3)
    assert (lim.max_grammar_bytes, lim.max_text_chars, lim.schema.max_rules) == (8 << 10, 1 << 20, 99)


def test_repacking_is_off_when_asked_or_on_cpus_with_amx_over_quantized_weights(tmp_path):
    from engine_pool.server.runtime import cpu_has_amx, repack_weights

    assert parse_settings(["-m", "m.gguf", "--no-repack"], {}).no_repack is True
    assert parse_settings(["-m", "m.gguf"], {"SLOTKEEPER_NO_REPACK": "on"}).no_repack is True
    assert parse_settings(["-m", "m.gguf"], {}).no_repack is False
    amx = tmp_path / "amx"
    amx.write_text("processor\t: 0\nflags\t\t: fpu sse avx512f amx_bf16 amx_tile amx_int8\n")
    plain = tmp_path / "plain"
    plain.write_text("processor\t: 0\nflags\t\t: fpu sse avx2\n")
    assert cpu_has_amx(str(amx)) and not cpu_has_amx(str(plain)) and not cpu_has_amx(str(tmp_path / "no"))
    f32, f16, q8_0, q4_k = 0, 1, 8, 12  # gguf.GGMLQuantizationType
    assert repack_weights(False, amx=True, weight_types={f32, f16})  # llama-server's AMX F16 matmuls
    assert not repack_weights(False, amx=True, weight_types={f32, q8_0, q4_k})  # llama.cpp #20824
    assert repack_weights(False, amx=False, weight_types={f32, q4_k})
    assert not repack_weights(True, amx=False, weight_types={f32})


def test_template_and_format_flags():
    argv = ["-m", "m.gguf", "--chat-format", "qwen-xml", "--reasoning-format", "none", "--jinja"]
    s = parse_settings(argv, {})
    assert (s.chat_format, s.reasoning_format, s.jinja) == ("qwen-xml", "none", True)
    for argv in (["--chat-format", "nope"], ["--reasoning-format", "sometimes"]):
        with pytest.raises(SettingsError, match=argv[0].lstrip("-").replace("-", "[-_]")):
            parse_settings(["-m", "m.gguf", *argv], {})


# -- llama-server drop-in flags (issue 10) ------------------------------------------------------------------
def test_drop_in_switches_and_their_opposites() -> None:
    argv = ["-m", "m.gguf", "-kvu", "--no-mmap", "--mlock", "--no-warmup", "--context-shift", "--no-slots"]
    s = parse_settings([*argv, "--metrics", "-v", "--offline"], {})
    assert (s.kv_unified, s.no_mmap, s.mlock, s.no_warmup, s.context_shift, s.no_slots) == (True,) * 6
    assert (s.metrics, s.verbose, s.offline) == (True, True, True)
    # llama-server's defaults: a unified KV cache, mmap, warm-up and context shift off; slots on; no
    # /metrics; not verbose.
    d = parse_settings(["-m", "m.gguf"], {})
    assert not any((d.kv_unified, d.no_mmap, d.mlock, d.no_warmup, d.context_shift, d.no_slots))
    assert not any((d.metrics, d.verbose, d.offline))
    # The other half of each pair; the last one given wins, as in llama-server.
    off = ["-no-kvu", "--mmap", "--warmup", "--no-context-shift", "--slots"]
    o = parse_settings([*argv, *off], {})
    assert not any((o.kv_unified, o.no_mmap, o.no_warmup, o.context_shift, o.no_slots))
    assert parse_settings(["-m", "m", "--no-kv-unified", "--kv-unified"], {}).kv_unified
    assert parse_settings(["-m", "m", "--log-verbose"], {}).verbose
    assert parse_settings(["-m", "m", "--verbose"], {}).verbose


def test_drop_in_variables_and_the_command_line_over_them() -> None:
    env = slotkeeper_env(
        context_shift="on",
        no_slots="1",
        metrics="yes",
        kv_unified="on",
        cache_type_k="q8_0",
        cache_type_v="q4_0",
        tags="a,b",
        cors_origins="https://x.example",
        verbose="on",
    )
    s = parse_settings(["-m", "m"], env)
    assert (s.context_shift, s.no_slots, s.metrics, s.kv_unified, s.verbose) == (True,) * 5
    assert (s.cache_type_k, s.cache_type_v, s.model_tags, s.cors_origin_list) == (
        "q8_0",
        "q4_0",
        ("a", "b"),
        ("https://x.example",),
    )
    o = parse_settings(["-m", "m", "--no-context-shift", "--slots", "-no-kvu", "-ctk", "bf16"], env)
    assert (o.context_shift, o.no_slots, o.kv_unified, o.cache_type_k) == (False, False, False, "bf16")


@pytest.mark.parametrize("kind", CACHE_TYPES)
def test_every_cache_type_llama_server_allows(kind: str) -> None:
    s = parse_settings(["-m", "m", "-ctk", kind, "--cache-type-v", kind], {})
    assert (s.cache_type_k, s.cache_type_v) == (kind, kind)


def test_aliases_tags_hosts_and_origins_are_comma_lists() -> None:
    s = parse_settings(
        ["-m", "dir/m.gguf", "-a", " first, second ,first,,third", "--tags", "chat, small"], {}
    )
    assert (
        s.aliases == ("first", "second", "third") and s.model_id == "first"
    )  # the alphabetically first (llama-server)
    assert s.model_tags == ("chat", "small")
    bare = parse_settings(["-m", "dir/m.gguf", "-a", " , "], {})
    assert (bare.aliases, bare.model_id, bare.model_tags) == ((), "m.gguf", ())
    h = parse_settings(["-m", "m", "--host", "127.0.0.1, ::1,/run/e.sock"], {})
    assert h.hosts == ("127.0.0.1", "::1", "/run/e.sock") and h.tcp_hosts == ("127.0.0.1", "::1")
    with pytest.raises(SettingsError, match="--port 0 is not supported"):
        parse_settings(["-m", "m", "--host", "127.0.0.1,::1", "--port", "0"], {})
    one_tcp = parse_settings(["-m", "m", "--host", "127.0.0.1,/run/e.sock", "--port", "0"], {})
    assert one_tcp.port == 0  # a UNIX socket takes no port
    assert parse_settings(["-m", "m"], {}).cors_origin_list == ("*",)
    assert parse_settings(["-m", "m", "--cors-origins", "localhost"], {}).cors_origin_list == ("localhost",)


def test_the_cors_flags_take_llama_servers_defaults_and_variables() -> None:
    d = parse_settings(["-m", "m"], {})
    assert (d.cors_methods, d.cors_headers, d.cors_credentials, d.ui_mcp_proxy) == (
        "GET, POST, DELETE, OPTIONS",
        "*",
        True,
        False,
    )
    s = parse_settings(
        [
            "-m",
            "m",
            "--cors-methods",
            "GET, POST",
            "--cors-headers",
            "Authorization",
            "--no-cors-credentials",
        ],
        {},
    )
    assert (s.cors_methods, s.cors_headers, s.cors_credentials) == ("GET, POST", "Authorization", False)
    env = {"SLOTKEEPER_CORS_CREDENTIALS": "off", "SLOTKEEPER_CORS_HEADERS": "Content-Type"}
    from_env = parse_settings(["-m", "m"], env)
    assert (from_env.cors_credentials, from_env.cors_headers) == (False, "Content-Type")
    assert parse_settings(["-m", "m", "--cors-credentials"], env).cors_credentials  # the flag wins
    # The proxy narrows the default to this machine's pages; an explicit --cors-origins still rules.
    assert parse_settings(["-m", "m", "--ui-mcp-proxy"], {}).cors_origin_list == ("localhost",)
    assert parse_settings(["-m", "m", "--webui-mcp-proxy", "--cors-origins", "*"], {}).cors_origin_list == (
        "*",
    )
    assert not parse_settings(["-m", "m", "--ui-mcp-proxy", "--no-ui-mcp-proxy"], {}).ui_mcp_proxy
    with pytest.raises(SettingsError, match="--cors-methods must be one or more methods"):
        parse_settings(["-m", "m", "--cors-methods", " , "], {})


def test_reasoning_is_on_off_or_auto() -> None:
    assert parse_settings(["-m", "m"], {}).reasoning == "auto"
    assert parse_settings(["-m", "m", "-rea", "off"], {}).reasoning == "off"
    assert parse_settings(["-m", "m"], {"SLOTKEEPER_REASONING": "on"}).reasoning == "on"
    with pytest.raises(SettingsError, match="--reasoning must be on, off or auto"):
        parse_settings(["-m", "m", "--reasoning", "maybe"], {})
    # llama-server's suite starts every server with --no-jinja: accepted (and logged), no effect.
    assert not parse_settings(["-m", "m", "--no-jinja"], {}).jinja


def test_verbose_means_debug_logs() -> None:
    assert parse_settings(["-m", "m", "-v", "--log-level", "error"], {}).effective_log_level == "debug"
    assert parse_settings(["-m", "m", "--log-level", "error"], {}).effective_log_level == "error"


def test_main_refuses_several_tcp_hosts_on_port_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["-m", "x", "--host", "127.0.0.1,127.0.0.2", "--port", "0"]) == 2
    assert "--port 0 is not supported with multiple TCP addresses" in capsys.readouterr().err
