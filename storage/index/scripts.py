"""The index's Lua scripts: each registered once per index (sent by SHA, loaded on a server the
first time it lacks it)."""

from __future__ import annotations

from typing import Any


class IndexScripts:
    """How the index's classes run scripts (a mixin: the class it is mixed into — the parts of
    :class:`storage.index.session_index.SessionIndex`, :class:`storage.index.epoch.IndexEpoch` —
    owns the client and the registry)."""

    _redis: Any
    _scripts: dict[str, Any]  # registered scripts by name

    def _script(self, name: str, source: str) -> Any:
        """The script ``name`` (``source``), registered on first use."""
        if name not in self._scripts:
            self._scripts[name] = self._redis.register_script(source)
        return self._scripts[name]
