"""native/model_gen.py: every generated architecture loads, decodes and tokenizes in llama.cpp, and carries
the chat template of the family it is made for."""

from __future__ import annotations

import ctypes
import importlib.util
import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import gguf
import jinja2.sandbox
import llama_cpp.llama_cpp as llama
import numpy as np
import pytest


def _load_model_gen() -> ModuleType:
    # Loaded from its file, not through the `native` package: the generator must work without the
    # compiled extension that native/__init__.py imports.
    path = Path(__file__).resolve().parents[2] / "native" / "model_gen.py"
    spec = importlib.util.spec_from_file_location("slotkeeper_model_gen", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


model_gen = _load_model_gen()

# arch -> (llama_model_is_hybrid, llama_model_is_recurrent, llama_model_n_swa)
EXPECTED_KIND = {
    "llama": (False, False, 0),
    "gemma2": (False, False, 32),
    "mamba2": (False, True, 0),
    "lfm2": (True, False, 0),
    "qwen35": (True, False, 0),
}
PROMPT = "Hello world! The model state is saved in a slot cache, then restored for the user."


@pytest.fixture(scope="module", autouse=True)
def _backend() -> None:
    llama.llama_backend_init()


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    paths = {}
    for arch in model_gen.ARCHS:
        paths[arch] = root / f"{arch}.gguf"
        model_gen.write_model(paths[arch], arch)
    return paths


@contextmanager
def _loaded(path: Path) -> Iterator[tuple[Any, Any]]:
    model = llama.llama_model_load_from_file(str(path).encode(), llama.llama_model_default_params())
    assert model, f"llama.cpp could not load {path}"
    params = llama.llama_context_default_params()
    params.n_ctx, params.n_batch, params.n_ubatch, params.n_seq_max = 256, 64, 64, 1
    params.n_threads = params.n_threads_batch = 2
    ctx = llama.llama_init_from_model(model, params)
    try:
        assert ctx
        yield model, ctx
    finally:
        if ctx:
            llama.llama_free(ctx)
        llama.llama_model_free(model)


@contextmanager
def _vocab(path: Path) -> Iterator[Any]:
    params = llama.llama_model_default_params()
    params.vocab_only = True
    model = llama.llama_model_load_from_file(str(path).encode(), params)
    assert model
    try:
        yield llama.llama_model_get_vocab(model)
    finally:
        llama.llama_model_free(model)


def _tokenize(vocab: Any, text: str, *, add_special: bool = False, parse_special: bool = False) -> list[int]:
    data = text.encode()
    buf = (llama.llama_token * (len(data) + 8))()
    n = llama.llama_tokenize(vocab, data, len(data), buf, len(buf), add_special, parse_special)
    assert n >= 0
    return list(buf[:n])


def _detokenize(vocab: Any, tokens: list[int], *, unparse_special: bool = False) -> str:
    arr = (llama.llama_token * max(len(tokens), 1))(*tokens)
    out = ctypes.create_string_buffer(32 * len(tokens) + 16)
    n = llama.llama_detokenize(vocab, arr, len(tokens), out, len(out), False, unparse_special)
    assert n >= 0
    return out.raw[:n].decode()


def _decode_all(model: Any, ctx: Any, tokens: list[int]) -> np.ndarray:
    """Decode `tokens` as one batch in sequence 0; return the logits of every position."""
    n_vocab = llama.llama_vocab_n_tokens(llama.llama_model_get_vocab(model))
    batch = llama.llama_batch_init(len(tokens), 0, 1)
    try:
        for i, token in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, i, 1, True
            batch.seq_id[i][0] = 0
        batch.n_tokens = len(tokens)
        assert llama.llama_decode(ctx, batch) == 0
        rows = [
            np.ctypeslib.as_array(llama.llama_get_logits_ith(ctx, i), shape=(n_vocab,))
            for i in range(len(tokens))
        ]
        return np.stack(rows).copy()
    finally:
        llama.llama_batch_free(batch)


def _prompt_logits(path: Path) -> np.ndarray:
    with _loaded(path) as (model, ctx):
        tokens = _tokenize(llama.llama_model_get_vocab(model), PROMPT, add_special=True)
        return _decode_all(model, ctx, tokens)


@pytest.mark.parametrize("arch", model_gen.ARCHS)
def test_loads_as_the_expected_memory_kind(tiny_models: dict[str, Path], arch: str) -> None:
    assert tiny_models[arch].stat().st_size < 8 * 2**20
    with _loaded(tiny_models[arch]) as (model, _):
        kind = (
            llama.llama_model_is_hybrid(model),
            llama.llama_model_is_recurrent(model),
            llama.llama_model_n_swa(model),
        )
    assert kind == EXPECTED_KIND[arch]


@pytest.mark.parametrize("arch", model_gen.ARCHS)
def test_decode_gives_finite_logits_that_vary(tiny_models: dict[str, Path], arch: str) -> None:
    logits = _prompt_logits(tiny_models[arch])
    assert 20 <= logits.shape[0] <= 64
    assert np.isfinite(logits).all()
    assert (logits.std(axis=1) > 0.1).all()  # not all equal within a position
    assert (np.abs(np.diff(logits, axis=0)).max(axis=1) > 0.1).all()  # and each position differs


@pytest.mark.parametrize("arch", model_gen.ARCHS)
def test_same_seed_same_bytes_other_seed_other_model(tmp_path: Path, arch: str) -> None:
    first, again, other = tmp_path / "a.gguf", tmp_path / "b.gguf", tmp_path / "c.gguf"
    model_gen.write_model(first, arch, seed=7)
    model_gen.write_model(again, arch, seed=7)
    model_gen.write_model(other, arch, seed=8)
    assert first.read_bytes() == again.read_bytes()
    assert first.read_bytes() != other.read_bytes()
    assert not np.allclose(_prompt_logits(first), _prompt_logits(other))


def test_header_records_seed_and_size(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    model_gen.write_model(path, "qwen35", seed=123)
    fields = gguf.GGUFReader(path).fields
    assert fields["general.name"].contents() == "slotkeeper-qwen35-tiny-seed123"
    assert fields["slotkeeper.seed"].contents() == 123
    assert fields["slotkeeper.size"].contents() == "tiny"
    assert fields["qwen35.full_attention_interval"].contents() == 4


@pytest.mark.parametrize(
    "text",
    [
        PROMPT,
        "  two leading spaces, trailing space ",
        "lines\nand\ttabs\r\n\n",
        "héllo wörld — ünïcödé",
        "中文字符 and 日本語のテキスト",
        "emoji 🎉👍🏽 and a family 👨‍👩‍👧",
        '{"name": "get_weather", "arguments": {"city": "Paris"}}',
        "<|im_start|> stays text without parse_special <|im_end|>",
        "",
    ],
)
def test_tokenizer_round_trips_utf8(tiny_models: dict[str, Path], text: str) -> None:
    with _vocab(tiny_models["qwen35"]) as vocab:
        assert _detokenize(vocab, _tokenize(vocab, text)) == text


def test_tokenizer_uses_pieces_and_chatml_specials(tiny_models: dict[str, Path]) -> None:
    with _vocab(tiny_models["qwen35"]) as vocab:
        assert len(_tokenize(vocab, "the user and the assistant")) <= 8  # words, not bytes
        im_start, *text, im_end = _tokenize(vocab, "<|im_start|>user\nHi<|im_end|>", parse_special=True)
        assert _detokenize(vocab, text) == "user\nHi"
        assert llama.llama_vocab_get_attr(vocab, im_start) & llama.LLAMA_TOKEN_ATTR_CONTROL
        assert llama.llama_vocab_eot(vocab) == im_end
        assert llama.llama_vocab_is_eog(vocab, im_end)
        assert not llama.llama_vocab_is_eog(vocab, im_start)
        assert llama.llama_vocab_eos(vocab) == 2
        assert _tokenize(vocab, "hi", add_special=True)[0] == llama.llama_vocab_bos(vocab)


def test_chat_template_renders_tools_calls_and_results() -> None:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment()
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "The user wants the weather.",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "18 C"},
        {"role": "tool", "tool_call_id": "c2", "content": "sunny"},
        {"role": "assistant", "content": [{"type": "text", "text": "18 C and sunny."}]},
        {"role": "user", "content": "Thanks"},
    ]
    rendered = env.from_string(model_gen.CHAT_TEMPLATE).render(
        messages=messages, tools=[tool], add_generation_prompt=True
    )
    tool_json = env.from_string("{{ t | tojson }}").render(t=tool)
    assert json.loads(tool_json) == tool
    assert rendered == (
        "<|im_start|>system\nBe brief.\n\n# Tools\n\n"
        "You may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        f"{tool_json}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n18 C\n</tool_response>\n"
        "<tool_response>\nsunny\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n18 C and sunny.<|im_end|>\n"
        "<|im_start|>user\nThanks<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    plain = env.from_string(model_gen.CHAT_TEMPLATE).render(
        messages=[{"role": "user", "content": "Hi"}], add_generation_prompt=False
    )
    assert plain == "<|im_start|>user\nHi<|im_end|>\n"


def test_family_tags_are_control_tokens_with_the_last_ids(tiny_models: dict[str, Path]) -> None:
    n = len(model_gen.FAMILY_TOKENS)
    vocab_ids = model_gen.build_vocab(1024)
    assert vocab_ids.tokens[-n:] == list(model_gen.FAMILY_TOKENS)
    with _vocab(tiny_models["lfm2"]) as vocab:
        for i, tag in enumerate(model_gen.FAMILY_TOKENS):
            # As in Liquid's GGUFs: one token when special text is parsed (templates), plain text
            # otherwise, and invisible in generated text unless rendered as special.
            assert _tokenize(vocab, tag, parse_special=True) == [1024 - n + i]
            assert len(_tokenize(vocab, tag)) > 1
            assert _detokenize(vocab, [1024 - n + i]) == ""
            assert _detokenize(vocab, [1024 - n + i], unparse_special=True) == tag
            assert not llama.llama_vocab_is_eog(vocab, 1024 - n + i)
        call = "<|tool_call_start|>[f(a=1)]<|tool_call_end|>"
        assert _detokenize(vocab, _tokenize(vocab, call, parse_special=True), unparse_special=True) == call


@pytest.mark.parametrize("name", model_gen.TEMPLATES)
def test_each_template_is_written_into_the_model(tmp_path: Path, name: str) -> None:
    path = tmp_path / "m.gguf"
    model_gen.write_model(path, "llama", template=name)
    source = gguf.GGUFReader(path).fields["tokenizer.chat_template"].contents()
    assert source == model_gen.chat_template(name)
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    assert "Hi" in env.from_string(source).render(
        messages=[{"role": "user", "content": "Hi"}], add_generation_prompt=True, bos_token="<s>"
    )
    default = tmp_path / "d.gguf"
    model_gen.write_model(default, "llama")
    assert gguf.GGUFReader(default).fields["tokenizer.chat_template"].contents() == model_gen.CHAT_TEMPLATE


def test_bench_is_a_realistic_qwen35() -> None:
    assert 180e6 < model_gen.param_count("qwen35", "bench") < 260e6
    dims = model_gen.ARCH_SPECS["qwen35"].sizes["bench"]
    attention = [il for il in range(dims.n_layer) if dims.is_attention(il)]
    assert (dims.n_embd, dims.n_layer, dims.n_vocab, len(attention)) == (1024, 16, 32000, 4)


def test_cli_writes_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "m.gguf"
    assert model_gen.main(["--arch", "lfm2", "--seed", "3", "--template", "lfm2", str(out)]) == 0
    fields = gguf.GGUFReader(out).fields
    assert fields["slotkeeper.seed"].contents() == 3
    assert fields["tokenizer.chat_template"].contents() == model_gen.chat_template("lfm2")
    assert "lfm2 tiny seed 3, lfm2 template" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == [out]  # no partial file left behind


@pytest.mark.parametrize(
    "argv",
    [
        ["--arch", "llama", "--size", "bench"],
        ["--arch", "gpt2"],
        ["--arch", "qwen35", "--seed", "-1"],
        ["--arch", "llama", "--template", "mistral"],
    ],
)
def test_cli_usage_errors_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        model_gen.main([*argv, str(tmp_path / "m.gguf")])
    assert exc.value.code == 2
    assert "error" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_write_model_rejects_unknown_arch_size_and_seed(tmp_path: Path) -> None:
    for arch, size, seed in [("gpt2", "tiny", 0), ("mamba2", "bench", 0), ("llama", "tiny", 2**32)]:
        with pytest.raises(ValueError):
            model_gen.write_model(tmp_path / "m.gguf", arch, size, seed)
    with pytest.raises(ValueError, match="unknown chat template"):
        model_gen.write_model(tmp_path / "m.gguf", "llama", template="mistral")
    assert not any(tmp_path.iterdir())
