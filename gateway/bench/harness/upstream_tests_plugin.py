"""A pytest plugin for llama.cpp's server suite (injected by `slotkeeper bench upstream-suite` with
`-p gateway.bench.harness.upstream_tests_plugin`): the suite's session fixture starts every preset
once, online, to download its models; here models are local (gateway/bench/harness/upstream_tests.py
maps them), so that step is skipped. `UPSTREAM_SUITE_REQUEST_TIMEOUT` bounds each request (the
suite's own bound is ten minutes), so one hung server costs a test, not the run."""

from __future__ import annotations

import os
import sys

import pytest


def pytest_sessionstart(session: pytest.Session) -> None:
    utils = sys.modules.get("utils")  # the suite's conftest has imported it by now
    if utils is None:
        raise pytest.UsageError("upstream_suite_plugin: the suite's utils module is not loaded")
    utils.ServerPreset.load_all = staticmethod(lambda: None)
    timeout = os.environ.get("UPSTREAM_SUITE_REQUEST_TIMEOUT")
    if timeout:
        for name in ("make_request", "make_any_request"):
            fn = getattr(utils.ServerProcess, name, None)
            defaults = getattr(fn, "__defaults__", None)
            if fn is None or not defaults:
                continue
            code = fn.__code__
            names = code.co_varnames[: code.co_argcount]
            slots = dict(zip(names[len(names) - len(defaults) :], defaults, strict=True))
            if "timeout" in slots:
                slots["timeout"] = float(timeout)
                fn.__defaults__ = tuple(slots.values())
