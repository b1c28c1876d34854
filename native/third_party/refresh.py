"""Refresh the vendored copy of llama.cpp's chat layer (`common/chat` and what it links) from the
llama-cpp-python sdist whose libllama the native module links, so both always come from one commit.

    python native/third_party/refresh.py [--sdist llama_cpp_python-X.tar.gz]

Without `--sdist` the version pinned in pyproject.toml is downloaded from the package registry
(`pip download --no-binary`). The copy lands in native/third_party/llama.cpp/ (the layout of
llama.cpp's tree, so its relative includes hold) with COMMIT naming the llama.cpp commit and the
llama-cpp-python version; CMake refuses to build when that version is not the installed one.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEST = HERE / "llama.cpp"
ROOT = HERE.parents[1]

# The chat layer, and the link closure common.cpp drags in. Not taken: the parts that need an HTTP
# client or TLS (arg, download, hf-cache, preset), llguidance, console, debug and subprocesses.
SOURCES = [
    "common/chat.cpp",
    "common/chat-auto-parser-generator.cpp",
    "common/chat-auto-parser-helpers.cpp",
    "common/chat-diff-analyzer.cpp",
    "common/chat-peg-parser.cpp",
    "common/peg-parser.cpp",
    "common/json-schema-to-grammar.cpp",
    "common/json-schema.cpp",
    "common/json.cpp",
    "common/unicode.cpp",
    "common/trie.cpp",
    "common/log.cpp",
    "common/common.cpp",
    "common/sampling.cpp",
    "common/speculative.cpp",
    "common/fit.cpp",
    "common/reasoning-budget.cpp",
    "common/ngram-cache.cpp",
    "common/ngram-map.cpp",
    "common/ngram-mod.cpp",
    "common/build-info.cpp.in",
]
TREES = ["common/jinja", "common/parsers"]  # whole folders
HEADERS = ["common/*.h", "common/*.hpp", "src/llama-ext.h", "vendor/nlohmann/json.hpp",
           "vendor/nlohmann/json_fwd.hpp"]  # fmt: skip
LICENSES = ["LICENSE"]


def pinned_version() -> str:
    text = (ROOT / "pyproject.toml").read_text()
    m = re.search(r'"llama-cpp-python==([^"]+)"', text)
    if m is None:
        sys.exit("pyproject.toml pins no llama-cpp-python version")
    return m.group(1)


def download(version: str, into: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                    f"llama-cpp-python=={version}", "-d", str(into)], check=True)  # fmt: skip
    return next(into.glob("llama_cpp_python-*.tar.gz"))


def vendored_commit(root: Path) -> str:
    """The llama.cpp commit the sdist vendors (its CHANGELOG's newest "update llama.cpp" line)."""
    m = re.search(
        r"update llama\.cpp to ggml-org/llama\.cpp@([0-9a-f]{7,40})", (root / "CHANGELOG.md").read_text()
    )
    return m.group(1) if m else "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sdist", type=Path, help="a llama-cpp-python sdist (default: download the pinned one)")
    args = ap.parse_args()
    version = pinned_version()
    with tempfile.TemporaryDirectory() as tmp:
        sdist = args.sdist or download(version, Path(tmp))
        if f"-{version}.tar.gz" not in sdist.name:
            sys.exit(f"{sdist.name} is not llama-cpp-python {version}, the version pyproject.toml pins")
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp, filter="data")
        top = Path(tmp) / sdist.name.removesuffix(".tar.gz")
        src = top / "vendor/llama.cpp"
        shutil.rmtree(DEST, ignore_errors=True)
        wanted = [src / p for p in SOURCES + LICENSES]
        for pattern in HEADERS:
            wanted += sorted(src.glob(pattern))
        for tree in TREES:
            wanted += sorted(p for p in (src / tree).rglob("*") if p.is_file())
        for path in wanted:
            out = DEST / path.relative_to(src)
            out.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, out)
        (DEST / "COMMIT").write_text(f"{vendored_commit(top)} llama-cpp-python=={version}\n")
    print(f"vendored {len(wanted)} files of llama.cpp {vendored_commit_text()} into {DEST}")


def vendored_commit_text() -> str:
    return (DEST / "COMMIT").read_text().strip()


if __name__ == "__main__":
    main()
