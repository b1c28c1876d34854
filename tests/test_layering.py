"""The packages' layering, read from the source: which package may import which.

The gateway speaks to engines and node agents only through their wire formats
(`engine_pool.protocol`) and the node client; it never reaches into the engine server or the node
agent's internals, so either side can change inside without the other noticing. `storage` sits
below both; `engine_pool.protocol` sits below the engine, the pool and the gateway, and depends on
the foundation alone: the error hierarchy (`engine_pool.errors`) and the HTTP and process layers
(`engine_pool.http`, `engine_pool.process`), which import nothing above them. Only imports written
in the source are checked (not module names handed to a subprocess as strings, like `gateway.cli`'s
process entry points).
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# The node-agent modules the gateway may import: its client, and — for the all-in-one
# `slotkeeper serve`, which runs a node agent in the gateway's process — the node's entry points.
GATEWAY_POOL_MODULES = {"engine_pool.pool.client"}
SERVE = ROOT / "gateway" / "serve.py"
SERVE_POOL_MODULES = {"engine_pool.pool.main", "engine_pool.pool.model_check", "engine_pool.pool.settings"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path) -> Iterator[tuple[int, str]]:
    """(line, absolute module name) of every import in `path`, relative ones resolved; an import of
    names from a package also yields `package.name` (it may be a submodule)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = _module_name(path).split(".")
    if path.name != "__init__.py":
        package.pop()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package[: len(package) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            yield node.lineno, base
            for alias in node.names:
                yield node.lineno, f"{base}.{alias.name}"


def sources(*packages: str) -> list[Path]:
    """The Python files under each package folder, or the file itself where one names a module."""
    return sorted(
        p for pkg in packages for p in ([ROOT / pkg] if pkg.endswith(".py") else (ROOT / pkg).rglob("*.py"))
    )


def _under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


Rule = Callable[[Path, str], str]  # (file, imported module) -> why it may not, or ""


def violations(paths: list[Path], rule: Rule) -> list[str]:
    out = []
    for path in paths:
        for line, name in imports(path):
            why = rule(path, name)
            if why:
                out.append(f"{path.relative_to(ROOT)}:{line}: {name} ({why})")
    return out


def _gateway_rule(path: Path, name: str) -> str:
    if _under(name, "engine_pool.server"):
        return "the engine server's internals: use engine_pool.protocol"
    if _under(name, "engine_pool.pool") and name != "engine_pool.pool":
        module = ".".join(name.split(".")[:3])
        allowed = GATEWAY_POOL_MODULES | (SERVE_POOL_MODULES if path == SERVE else set())
        if module not in allowed:
            return "the node agent's internals: use engine_pool.pool.client and engine_pool.protocol.node"
    return ""


def _storage_rule(path: Path, name: str) -> str:
    for above in ("engine_pool.server", "engine_pool.pool", "gateway"):
        if _under(name, above):
            return f"storage sits below {above}"
    return ""


def _protocol_rule(path: Path, name: str) -> str:
    for other in ("engine_pool.server", "engine_pool.pool", "gateway", "storage", "native"):
        if _under(name, other):
            return "the protocol depends on the foundation alone"
    return ""


FOUNDATION = {"engine_pool.errors", "engine_pool.http", "engine_pool.process"}
# What the foundation imports of the layers below it: the errors it renders.
FOUNDATION_BELOW = {"storage.errors", "native.errors"}


def _foundation_rule(path: Path, name: str) -> str:
    if any(_under(name, layer) for layer in FOUNDATION | FOUNDATION_BELOW):
        return ""
    if name in ("storage", "native"):  # `from native import errors` names the package too
        return ""
    if any(_under(name, other) for other in ("engine_pool", "gateway", "storage", "native")):
        return "the foundation imports only itself and the errors it renders"
    return ""


def _runtime_rule(path: Path, name: str) -> str:
    """The benchmarks ship in the wheel (`slotkeeper bench` runs from an installed package) but
    stay out of the runtime's imports: only `gateway.cli` names them, as a string it imports when
    the command runs (docs/architecture.md, "Layers")."""
    if _under(name, "gateway.bench") and not path.is_relative_to(ROOT / "gateway" / "bench"):
        return "the benchmarks are no part of the runtime"
    return ""


@pytest.mark.parametrize(
    ("packages", "rule"),
    [
        (("gateway",), _gateway_rule),
        (("storage",), _storage_rule),
        (("engine_pool/protocol",), _protocol_rule),
        (("engine_pool/errors.py", "engine_pool/http", "engine_pool/process"), _foundation_rule),
        (("gateway", "engine_pool", "storage", "native"), _runtime_rule),
    ],
    ids=["gateway", "storage", "protocol", "foundation", "runtime"],
)
def test_each_package_imports_only_what_lies_below_it(packages: tuple[str, ...], rule: Rule) -> None:
    paths = sources(*packages)
    assert paths, f"no sources under {packages}"
    assert violations(paths, rule) == []


def test_the_check_resolves_relative_imports_and_knows_the_exceptions() -> None:
    """A check that saw nothing would pass: relative imports resolve against the file's package,
    and the rules refuse what they should and let the node client through."""
    request = ROOT / "engine_pool" / "protocol" / "openai_responses" / "request.py"
    names = {name for _, name in imports(request)}
    assert {"engine_pool.http.body", "engine_pool.protocol.bounds"} <= names
    serving = ROOT / "gateway" / "turn" / "serving.py"
    assert _gateway_rule(serving, "engine_pool.server.sse")
    assert _gateway_rule(serving, "engine_pool.pool.agent")
    assert _gateway_rule(serving, "engine_pool.pool.main")
    assert not _gateway_rule(serving, "engine_pool.pool.client")
    assert not _gateway_rule(serving, "engine_pool.protocol.node")
    assert not _gateway_rule(SERVE, "engine_pool.pool.main")
    assert _runtime_rule(SERVE, "gateway.bench.harness.servers")
    assert not _runtime_rule(ROOT / "gateway" / "bench" / "soak.py", "gateway.bench.harness.servers")
    errors = ROOT / "engine_pool" / "errors.py"
    assert not _foundation_rule(errors, "storage.errors")
    assert _foundation_rule(errors, "storage.index.records")
    assert _foundation_rule(errors, "engine_pool.protocol.sse")
