"""What the tool fields of the chat, Responses and Messages requests share: a tool's name is a
non-empty string that no earlier tool of the list has taken; a `tool_choice` given as a string is
one of the API's modes, and "required" needs tools; a tool is of the one type the API's tools
must be here. Pure."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from engine_pool.errors import BadRequest
from engine_pool.http.body import Body


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


def tools_of_type(body: Body, kind: str, default: str | None, refusal: str) -> Iterator[Body]:
    """Each entry of the array `tools` (none when absent), refused (400) unless its `type` (`default`
    when absent) is `kind`, the one this API's tools must be here: `refusal` ends that message."""
    for tool in body.objects("tools"):
        got = tool.get_str("type", default)
        if got != kind:
            raise BadRequest(f"'{tool.path}': tool type {got!r} {refusal}", param=tool.path)
        yield tool


def tool_choice_mode(raw: str, modes: tuple[str, ...], names: Sequence[str]) -> str:
    """`raw`, a string `tool_choice`, refused (400) unless it is one of `modes` (listed in the API's
    order) or when it is "required" and there are no tools (`names`: theirs)."""
    if raw not in modes:
        raise BadRequest(
            f"'tool_choice' must be {', '.join(modes)} or a function; got {raw!r}", param="tool_choice"
        )
    if raw == "required" and not names:
        raise BadRequest("'tool_choice' is 'required' but no 'tools' were given", param="tool_choice")
    return raw
