"""Draws docs/architecture.svg, the README's picture of Slotkeeper's parts.

The picture is a table of boxes and arrows rendered to plain SVG text, so it needs no graphviz and
its output is byte-for-byte reproducible: tests/test_docs.py checks that the committed SVG is what
this script writes. Edit the tables, then run `python3 docs/architecture.py`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from html import escape
from pathlib import Path

WIDTH, HEIGHT = 920, 600
FONT = 'font-family="Helvetica, Arial, sans-serif"'


@dataclass(frozen=True)
class Box:
    """A part: where it is (x, y, width, height), its title (bold), up to three lines of what it does."""

    at: tuple[int, int, int, int]
    title: str
    lines: tuple[str, ...] = ()
    fill: str = "#eef3fb"
    stack: int = 1  # drawn as this many overlapping copies (replicas)


@dataclass(frozen=True)
class Arrow:
    """A straight arrow from `start` to `end`; its label sits right of a vertical arrow's middle,
    above a horizontal one's. `both` puts a head on each end."""

    start: tuple[int, int]
    end: tuple[int, int]
    label: str = ""
    both: bool = False


# Boxes with `stack` copies reach 5 px right and down per copy: arrows start clear of them.
BOXES: tuple[Box, ...] = (
    Box(
        (40, 20, 840, 62),
        "agents and SDKs",
        ("Claude Code · Codex CLI · OpenCode · OpenAI Agents SDK · openai / anthropic SDKs · curl",),
        fill="#f6f6f6",
    ),
    Box(
        (40, 150, 420, 92),
        "gateway  (stateless, N replicas)",
        ("tenants · session resolution · placement and eviction", "quotas · write-behind saves · metrics"),
        stack=3,
    ),
    Box(
        (600, 150, 280, 92),
        "session index",
        (
            "Redis, or in-process on one machine",
            "sessions · prefix digests · locks",
            "engine registry · usage counters",
        ),
        fill="#fdf3e4",
    ),
    Box(
        (40, 320, 270, 92),
        "node agent  (one per node)",
        ("supervises the engine processes", "spill and fill of slot files", "drain on SIGTERM"),
    ),
    Box(
        (420, 320, 460, 92),
        "engine processes  (one model each, N slots)",
        (
            "llama-server-compatible HTTP front",
            "native core over libllama: batching, checkpoints,",
            "stored logits, slot files",
        ),
        stack=2,
    ),
    Box(
        (40, 480, 270, 92),
        "spill cache  (local disk)",
        ("recent slot files, LRU by bytes", "uploads retried until stored"),
        fill="#eef8ee",
    ),
    Box(
        (420, 480, 460, 92),
        "blob store  (local directory or S3)",
        ("the source of truth: content-addressed chunks", "and one manifest per stored generation"),
        fill="#eef8ee",
    ),
)

ARROWS: tuple[Arrow, ...] = (
    Arrow((250, 86), (250, 146), "Chat Completions · Responses · Anthropic Messages"),
    Arrow((474, 196), (596, 196), "records · locks", both=True),
    Arrow((175, 256), (175, 316), "spill · fill · erase"),
    Arrow((400, 256), (560, 316), "each turn, straight to its slot"),
    Arrow((314, 366), (416, 366), "save · restore", both=True),
    Arrow((175, 416), (175, 476), "slot files"),
    Arrow((314, 526), (416, 526), "chunks", both=True),
)


def _text(x: int, y: int, text: str, *, size: int = 13, bold: bool = False, anchor: str = "start") -> str:
    weight = ' font-weight="bold"' if bold else ""
    return (
        f'<text x="{x}" y="{y}" {FONT} font-size="{size}"{weight} text-anchor="{anchor}" '
        f'fill="#1b1f24">{escape(text)}</text>'
    )


def _box(b: Box) -> list[str]:
    x, y, w, h = b.at
    out = []
    for i in reversed(range(b.stack)):  # back copies first, offset down and right
        off = 5 * i
        out.append(
            f'<rect x="{x + off}" y="{y + off}" width="{w}" height="{h}" rx="8" '
            f'fill="{b.fill}" stroke="#44515f" stroke-width="1.2"/>'
        )
    out.append(_text(x + 14, y + 24, b.title, size=15, bold=True))
    out += [_text(x + 14, y + 46 + 18 * i, line) for i, line in enumerate(b.lines)]
    return out


def _arrow(a: Arrow) -> list[str]:
    (x1, y1), (x2, y2) = a.start, a.end
    start = ' marker-start="url(#head)"' if a.both else ""
    out = [
        f'<line x1="{x1}" y1="{y1}" x2="{x2}" y2="{y2}" stroke="#44515f" stroke-width="1.6" '
        f'marker-end="url(#head)"{start}/>'
    ]
    if a.label:
        mx, my = (x1 + x2) // 2, (y1 + y2) // 2
        if y1 == y2:
            out.append(_text(mx, my - 8, a.label, size=12, anchor="middle"))
        else:  # a diagonal one's label keeps clear of its slope
            out.append(_text(mx + (10 if x1 == x2 else 24), my + 4, a.label, size=12))
    return out


def render() -> str:
    """The whole SVG document (deterministic: same tables, same bytes)."""
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
        f'viewBox="0 0 {WIDTH} {HEIGHT}" role="img" aria-label="Slotkeeper architecture">',
        "<defs>",
        '<marker id="head" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="8" markerHeight="8" '
        'orient="auto-start-reverse"><path d="M 0 0 L 10 5 L 0 10 z" fill="#44515f"/></marker>',
        "</defs>",
        f'<rect width="{WIDTH}" height="{HEIGHT}" fill="#ffffff"/>',
    ]
    for box in BOXES:
        parts += _box(box)
    for arrow in ARROWS:
        parts += _arrow(arrow)
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def main(argv: list[str]) -> int:
    out = Path(argv[0]) if argv else Path(__file__).with_suffix(".svg")
    out.write_text(render(), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
