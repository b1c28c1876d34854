"""The `slotkeeper` command as a person reads it: every command's --help states each default once."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from engine_pool.process.flags import parse_bytes


def _same(a: str, b: str) -> bool:
    """Whether two spellings of a default mean one value: 16M and 16777216, 60 and 60.0."""
    if a == b:
        return True
    try:
        return float(parse_bytes(a) if not re.fullmatch(r"-?\d+\.\d*", a) else a) == float(
            parse_bytes(b) if not re.fullmatch(r"-?\d+\.\d*", b) else b
        )
    except ValueError:
        return False


def option_blocks(text: str) -> list[str]:
    """Each option's help, its wrapped lines joined (argparse's layout: a block starts at `  -`)."""
    blocks: list[str] = []
    for line in text.splitlines():
        if re.match(r"^  -", line):
            blocks.append(line.strip())
        elif blocks and line.startswith("      "):
            blocks[-1] += " " + line.strip()
    return blocks


@pytest.mark.parametrize("command", ["serve", "gateway", "node", "engine"])
def test_every_default_is_said_once(command: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "gateway.cli", command, "--help"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    blocks = option_blocks(out.stdout)
    assert len(blocks) > 10, out.stdout
    twice = []
    for block in blocks:
        stated = re.findall(r"\(default:? ([^()\s]+)\)", block)
        others = [p.split(";")[0].split(",")[0].strip() for p in re.findall(r"\(([^()]*)\)", block)]
        others = [o for o in others if not o.startswith("default")]
        if len(stated) > 1 or any(_same(s, o) for s in stated for o in others):
            twice.append(block)
    assert twice == [], "\n".join(twice)
