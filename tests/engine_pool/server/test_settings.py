"""engine_pool/server/settings.py: llama-server's flags, SLOTKEEPER_* variables, one frozen object."""

from __future__ import annotations

import dataclasses

import pytest

from engine_pool.body import BodyLimits
from engine_pool.server.engine_main import main
from engine_pool.server.grammar import GrammarLimits
from engine_pool.server.limits import RequestLimits
from engine_pool.server.settings import FLAGS, EngineSettings, SettingsError, parse_settings


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
    env = {
        "SLOTKEEPER_MODEL": "env.gguf",
        "SLOTKEEPER_PARALLEL": "3",
        "SLOTKEEPER_PORT": "7000",
        "SLOTKEEPER_SWA_FULL": "yes",
    }
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
    ],
)
def test_bad_flags_and_variables_are_clear_errors(argv: list[str], env: dict[str, str], message: str) -> None:
    with pytest.raises(SettingsError) as exc:
        parse_settings(argv, env)
    assert message in str(exc.value)


def test_every_field_has_exactly_one_row() -> None:
    fields = {f.name for f in dataclasses.fields(EngineSettings)}
    rows = [f.field for f in FLAGS]
    assert sorted(rows) == sorted(fields)
    assert all(f.env.startswith("SLOTKEEPER_") for f in FLAGS)
    flags = [flag for f in FLAGS for flag in f.flags]
    assert len(flags) == len(set(flags))


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


def test_repacking_is_off_when_asked_or_on_cpus_with_amx(tmp_path):
    from engine_pool.server.runtime import cpu_has_amx

    assert parse_settings(["-m", "m.gguf", "--no-repack"], {}).no_repack is True
    assert parse_settings(["-m", "m.gguf"], {"SLOTKEEPER_NO_REPACK": "on"}).no_repack is True
    assert parse_settings(["-m", "m.gguf"], {}).no_repack is False
    amx = tmp_path / "amx"
    amx.write_text("processor\t: 0\nflags\t\t: fpu sse avx512f amx_bf16 amx_tile amx_int8\n")
    plain = tmp_path / "plain"
    plain.write_text("processor\t: 0\nflags\t\t: fpu sse avx2\n")
    assert cpu_has_amx(str(amx)) and not cpu_has_amx(str(plain)) and not cpu_has_amx(str(tmp_path / "no"))


def test_template_and_format_flags():
    argv = ["-m", "m.gguf", "--chat-format", "qwen-xml", "--reasoning-format", "none", "--jinja"]
    s = parse_settings(argv, {})
    assert (s.chat_format, s.reasoning_format, s.jinja) == ("qwen-xml", "none", True)
    for argv in (["--chat-format", "nope"], ["--reasoning-format", "sometimes"]):
        with pytest.raises(SettingsError, match=argv[0].lstrip("-").replace("-", "[-_]")):
            parse_settings(["-m", "m.gguf", *argv], {})
