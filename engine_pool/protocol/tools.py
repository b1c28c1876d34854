"""What the Responses and Messages tool lists share: a tool's name is a non-empty string that no
earlier tool of the list has taken. Pure."""

from __future__ import annotations

from collections.abc import Iterable

from ..common.body import Body
from ..common.errors import BadRequest


def tool_name(tool: Body, taken: Iterable[str], noun: str) -> str:
    """`tool.name`, refused (400) when empty or when one of `taken` (the earlier tools' names) is
    the same; `noun` names a tool in that API's words (tool, function)."""
    name = tool.get_str("name")
    where = tool.name("name")
    if not name:
        raise BadRequest(f"'{where}' must be a non-empty string", param=where)
    if name in taken:
        raise BadRequest(f"'{where}': {noun} {name!r} is defined twice", param=where)
    return name
