"""``slotkeeper inspect FILE``: what a slot file holds and whether it is intact.

Prints the model fingerprint and architecture, token count, checkpoints (positions and bytes),
sizes by section (they add up to the size on disk) and the checksum verdict; ``--json`` prints the
same as one JSON object. Exit status: 0 valid, 1 invalid (any slot-file error or a checksum
mismatch), 2 usage or I/O error.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from storage.errors import SlotFileError
from storage.slotfile import SlotFile, read_slot_file


def describe(sf: SlotFile) -> dict[str, Any]:
    """The JSON-ready description of a parsed slot file."""
    listed_kinds = sf.meta.get("checkpoints")
    kinds: list[Any] = listed_kinds if isinstance(listed_kinds, list) else []
    checkpoints = []
    for i, c in enumerate(sf.checkpoints):
        listed = kinds[i] if i < len(kinds) and isinstance(kinds[i], dict) else {}
        checkpoints.append(
            {
                "n_tokens": c.n_tokens,
                "pos_min": c.pos_min,
                "pos_max": c.pos_max,
                "target_bytes": c.target_bytes_len,
                "draft_bytes": c.draft_bytes_len,
                "spec_bytes": c.spec_bytes_len,
                "kind": listed.get("kind"),
            }
        )
    return {
        "path": sf.path,
        "size": sf.size,
        "format": f"{sf.format_major}.{sf.format_minor}",
        "state_version": sf.state_version,
        "n_tokens": sf.n_tokens,
        "model": sf.model,
        "llama": sf.meta.get("llama"),
        "context": sf.meta.get("context"),
        "engine_version": sf.meta.get("engine_version"),
        "created": sf.meta.get("created"),
        "checkpoints": checkpoints,
        "sizes": dict(sf.sizes) | {"state": sf.state_len, "tokens": 4 * sf.n_tokens},
        "records": [{"tag": r.tag, "bytes": r.length} for r in sf.records],
        "checksum": {
            "ok": sf.checksum_ok,
            "stored": f"{sf.body_crc32:08x}",
            "computed": None if sf.computed_crc32 is None else f"{sf.computed_crc32:08x}",
        },
        "notes": list(sf.notes),
    }


def _bytes(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit} ({n} B)"
    return f"{n} B"


def render(info: dict[str, Any]) -> str:
    """The human-readable form of :func:`describe`'s output."""
    model = info["model"] or {}
    kind = "hybrid" if model.get("hybrid") else "recurrent" if model.get("recurrent") else "attention"
    lines = [
        f"file         {info['path']}  {_bytes(info['size'])}",
        f"format       v{info['format']}  llama state v{info['state_version']}",
        f"model        {model.get('fingerprint', '?')}",
        f"arch         {model.get('arch', '?')} ({kind}, n_vocab {model.get('n_vocab', '?')})",
        f"tokens       {info['n_tokens']}",
        f"checkpoints  {len(info['checkpoints'])}",
    ]
    for i, c in enumerate(info["checkpoints"]):
        lines.append(
            f"  #{i:<3} n_tokens {c['n_tokens']:<8} pos {c['pos_min']}..{c['pos_max']:<8} "
            f"target {_bytes(c['target_bytes'])}" + (f"  [{c['kind']}]" if c["kind"] else "")
        )
    lines.append("sizes")
    sizes = info["sizes"]
    for name in ("base", "checkpoints", "metadata", "logits", "trailer"):
        lines.append(f"  {name:<12} {_bytes(sizes[name])}")
    lines.append(f"  {'(state)':<12} {_bytes(sizes['state'])}")
    verdict = {True: "ok", False: "MISMATCH", None: "not checked"}[info["checksum"]["ok"]]
    computed = info["checksum"]["computed"]
    lines.append(f"checksum     {verdict} (stored crc32 {info['checksum']['stored']}, computed {computed})")
    lines += [f"note         {note}" for note in info["notes"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``slotkeeper inspect``; ``argv`` excludes the program name."""
    parser = argparse.ArgumentParser(prog="slotkeeper inspect", description="Inspect and verify a slot file.")
    parser.add_argument("file", help="path of a slot file (format v1)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--no-checksum", action="store_true", help="skip the streamed body CRC")
    args = parser.parse_args(argv)
    try:
        sf = read_slot_file(args.file, checksum=not args.no_checksum)
    except SlotFileError as exc:
        error = {"kind": exc.kind, "message": str(exc), "offset": exc.offset}
        if args.json:
            print(json.dumps({"path": args.file, "valid": False, "error": error}))
        else:
            print(f"{args.file}: invalid slot file: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"{args.file}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    info = describe(sf)
    valid = sf.checksum_ok is not False
    if args.json:
        print(json.dumps({"valid": valid, "error": None} | info))
    else:
        print(render(info))
    return 0 if valid else 1
