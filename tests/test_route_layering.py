"""The engine's route modules are edges: nothing but the engine's app imports them.

A **route module** is a module of `engine_pool/server` whose top level defines a Starlette route
table for `app.build_app` to mount: a module-level `ROUTES` list, or a `routes()` function that
returns one (Vertex AI's, whose path is a setting). A route module parses a request, calls services
and renders the answer; what it calls lives in service modules (`chat_pipeline`,
`completion_prompts`, `completion_result`, `openai_answer`, `route_context`, ...), which any route
may import. So no module of `engine_pool` but `engine_pool.server.app` imports a route module: not
another route module (`apis.routes` once took `run_chat` from `routes_openai`), and not a service.
Checked with `test_layering.imports`, the same reading of the source as the packages' layering.
"""

from __future__ import annotations

import ast
from pathlib import Path

from test_layering import ROOT, Rule, _module_name, _under, imports, sources, violations

APP = "engine_pool.server.app"
# Builds `Route`s for the route modules (llama-server's aliased paths) but mounts none itself.
ROUTE_BUILDER = "engine_pool.server.route_context"


def _defines_a_route_table(tree: ast.Module) -> bool:
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == "routes":
            return True
        targets = node.targets if isinstance(node, ast.Assign) else []
        if isinstance(node, ast.AnnAssign):
            targets = [node.target]
        if any(isinstance(t, ast.Name) and t.id == "ROUTES" for t in targets):
            return True
    return False


def route_modules() -> dict[str, Path]:
    """Each route module of the engine server (see the module's docstring), by module name."""
    out = {}
    for path in sources("engine_pool/server"):
        if _defines_a_route_table(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            out[_module_name(path)] = path
    return out


def _route_rule(routes: set[str]) -> Rule:
    def rule(path: Path, name: str) -> str:
        if _module_name(path) == APP:
            return ""
        hit = next((r for r in routes if _under(name, r)), None)
        return (
            f"{hit} is a route module: only {APP} imports it; move what you need into a service"
            if hit
            else ""
        )

    return rule


def test_the_route_modules_are_the_engines_route_tables() -> None:
    """The definition finds the route tables the app mounts, and every module that builds a
    Starlette `Route` is one of them (or the one that builds aliased routes for them), so a route
    table under another name could not slip past the rule."""
    found = route_modules()
    assert {
        "engine_pool.server.routes_llama",
        "engine_pool.server.routes_openai",
        "engine_pool.server.apis.routes",
        "engine_pool.server.apis.vertex",
        "engine_pool.server.cors_proxy",
    } <= set(found)
    builders = {
        _module_name(path)
        for path in sources("engine_pool/server")
        if any(name == "starlette.routing.Route" for _, name in imports(path))
    }
    assert builders <= set(found) | {ROUTE_BUILDER}
    app_imports = {name for _, name in imports(ROOT / "engine_pool" / "server" / "app.py")}
    assert set(found) <= app_imports, "a route module the app does not mount"


def test_no_module_but_the_app_imports_a_route_module() -> None:
    routes = set(route_modules())
    assert violations(sources("engine_pool"), _route_rule(routes)) == []


def test_the_rule_refuses_a_route_importing_a_route() -> None:
    """A check that saw nothing would pass: the import that issue 46 removed is refused, a
    service import is let through, and the app may import every route module."""
    rule = _route_rule(set(route_modules()))
    apis_routes = ROOT / "engine_pool" / "server" / "apis" / "routes.py"
    assert rule(apis_routes, "engine_pool.server.routes_openai.run_chat")
    assert rule(ROOT / "engine_pool" / "server" / "chat_pipeline.py", "engine_pool.server.routes_llama")
    assert not rule(apis_routes, "engine_pool.server.chat_pipeline.run_chat")
    assert not rule(ROOT / "engine_pool" / "server" / "app.py", "engine_pool.server.routes_llama")
