"""``slotkeeper inspect FILE|SESSION``: what a slot file, or a stored generation's manifest, holds
and whether it is intact.

A session id (with ``--tenant``, ``default`` for serve's open tenant, and ``--data-dir``, serve's
``.slotkeeper`` unless given) names its newest stored generation in that data directory's local
store: its manifest is inspected. An argument that is neither a file nor a stored session is an
error that says what to pass.

A slot file: the model fingerprint and architecture, token count, checkpoints (positions and bytes),
sizes by section (they add up to the size on disk) and the checksum verdict. A manifest
(``{tenant}/{session}/{generation}.manifest`` in a local store, e.g. serve's
``.slotkeeper/blobs/slotkeeper/``): its session and generation, model, routing digests, tokens, and
the pieces it names by kind (attention KV chunks, checkpoints, its own tail) with their bytes as
restored and as stored, each looked up beside it (a piece missing makes it invalid). ``--json``
prints the same as one JSON object. Exit status: 0 valid, 1 invalid, 2 usage or I/O error.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from storage.chunks.chunking import objects_needed
from storage.errors import InvalidId, SlotFileError
from storage.ids import tenant_prefix
from storage.index.prefix_digests import split_routes
from storage.slotfile.reader import SlotFile, read_slot_file

MANIFEST_FORMAT = "slotkeeper-manifest/1"  # (storage.chunks.chunkstore writes it)
_KINDS = {"kv": "attention KV chunks", "ck": "checkpoints", "tl": "tail (its own tokens and state)"}


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


def describe_manifest(path: Path, doc: dict[str, Any]) -> dict[str, Any]:
    """The JSON-ready description of a manifest, its pieces looked up in the store around it
    (``{tenant}/.chunks/{ns[:32]}/{name}.{kind}``, the tail beside it). Raises ValueError, KeyError
    or TypeError on a document that is not a manifest's."""
    if doc.get("format") != MANIFEST_FORMAT:
        raise ValueError(f"not a slotkeeper manifest (format {doc.get('format')!r})")
    plan, stored = doc["plan"], doc.get("stored") or {}
    tenant_dir = path.resolve().parent.parent
    pieces: dict[str, dict[str, int]] = {}
    missing = []
    for kind, name, size in objects_needed(plan):
        where = (
            path.with_suffix(".tail")
            if kind == "tl"
            else tenant_dir / ".chunks" / str(doc["ns"])[:32] / f"{name}.{kind}"
        )
        entry = pieces.setdefault(kind, {"count": 0, "bytes": 0, "stored_bytes": 0})
        entry["count"] += 1
        entry["bytes"] += size
        entry["stored_bytes"] += int(stored.get(name, size))
        if not where.is_file():
            missing.append(str(where))
    route, shared, prompt, head = split_routes(str(doc.get("route") or ""))
    return {
        "path": str(path),
        "kind": "manifest",
        "tenant": doc["tenant"],
        "session": doc["session"],
        "generation": doc["generation"],
        "created": doc.get("created"),
        "model": doc.get("model"),
        "routes": {"route": route, "shared": shared, "prompt": prompt, "head": head},
        "n_tokens": plan["n_tokens"],
        "state_version": plan["state_version"],
        "slot_file_bytes": plan["size"],
        "pieces": pieces,
        "missing": missing,
    }


def render_manifest(info: dict[str, Any]) -> str:
    """The human-readable form of :func:`describe_manifest`'s output."""
    lines = [
        f"manifest     {info['path']}",
        f"session      {info['tenant']}/{info['session']}  generation {info['generation']}",
        f"model        {info['model']}",
        f"tokens       {info['n_tokens']}  (slot file {_bytes(info['slot_file_bytes'])})",
    ]
    lines += [f"{name:<12} {digest}" for name, digest in info["routes"].items() if digest]
    lines.append("pieces")
    for kind, entry in info["pieces"].items():
        lines.append(
            f"  {_KINDS[kind]:<32} {entry['count']:>4}  {_bytes(entry['bytes'])}, "
            f"stored {_bytes(entry['stored_bytes'])}"
        )
    lines += [f"missing      {m}" for m in info["missing"]]
    lines.append(
        "verdict      " + ("ok" if not info["missing"] else f"{len(info['missing'])} pieces missing")
    )
    return "\n".join(lines)


def _manifest_main(path: Path, as_json: bool) -> int:
    try:
        info = describe_manifest(path, json.loads(path.read_bytes()))
    except (ValueError, KeyError, TypeError) as exc:
        if as_json:
            print(
                json.dumps(
                    {
                        "path": str(path),
                        "valid": False,
                        "error": {"kind": "bad_manifest", "message": str(exc)},
                    }
                )
            )
        else:
            print(f"{path}: invalid manifest: {exc}", file=sys.stderr)
        return 1
    valid = not info["missing"]
    print(json.dumps({"valid": valid, "error": None} | info) if as_json else render_manifest(info))
    return 0 if valid else 1


class NotFound(Exception):
    """Neither a file nor a stored session: the message says what to pass instead."""


def session_manifest(data_dir: Path, prefix: str, tenant: str, session: str) -> Path:
    """The newest stored generation's manifest of `session` in a data directory's local store
    (``{data_dir}/blobs/{prefix}/{tenant}/{session}/{generation}.manifest``)."""
    try:
        folder = data_dir / "blobs" / tenant_prefix(prefix, tenant, session)
    except InvalidId as exc:
        raise NotFound(f"{session!r} is no file, and no session id: {exc}") from None
    manifests = sorted(folder.glob("*.manifest"))
    if manifests:
        return manifests[-1]
    store = data_dir / "blobs" / prefix
    if not store.is_dir():
        where = f"{data_dir} holds no local store (no blobs/{prefix}/)"
        what = "pass --data-dir with serve's data directory (and --prefix with its --s3-prefix)"
    else:
        tenants = sorted(p.name for p in store.iterdir() if p.is_dir() and not p.name.startswith("."))
        # (no session id starts with '.': `.chunks` holds the tenant's pieces)
        listed = (store / tenant).iterdir() if tenant in tenants else iter(())
        sessions = sorted(p.name for p in listed if p.is_dir() and not p.name.startswith("."))
        where = f"no stored session {session!r} of tenant {tenant!r} in {store}"
        if sessions:
            shown = ", ".join(sessions[:5]) + (", ..." if len(sessions) > 5 else "")
            what = f"its stored sessions: {shown} (`slotkeeper sessions list --data-dir {data_dir}`)"
        else:
            what = (
                f"pass --tenant with one of: {', '.join(tenants)}"
                if tenants
                else "nothing is stored there yet"
            )
    raise NotFound(f"{session!r} is no file, and {where}: {what}")


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``slotkeeper inspect``; ``argv`` excludes the program name."""
    parser = argparse.ArgumentParser(
        prog="slotkeeper inspect",
        description="Inspect and verify a slot file, a stored manifest, or a stored session's newest "
        "generation.",
    )
    parser.add_argument(
        "file",
        metavar="FILE|SESSION",
        help="a slot file (format v1), a .manifest in a local store, or a session id "
        "(with --tenant, --data-dir)",
    )
    parser.add_argument(
        "--tenant", default="default", help="a session id's tenant (default: serve's open one)"
    )
    parser.add_argument(
        "--data-dir", default=".slotkeeper", help="a session id's data dir: serve's (.slotkeeper)"
    )
    parser.add_argument("--prefix", default="slotkeeper", help="serve's --s3-prefix (slotkeeper)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--no-checksum", action="store_true", help="skip the streamed body CRC")
    args = parser.parse_args(argv)
    if not Path(args.file).exists():
        try:
            args.file = str(session_manifest(Path(args.data_dir), args.prefix, args.tenant, args.file))
        except NotFound as exc:
            print(f"slotkeeper inspect: {exc}", file=sys.stderr)
            return 2
    try:
        with open(args.file, "rb") as f:
            head = f.read(1)
    except OSError as exc:
        print(f"slotkeeper inspect: {args.file}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    if head == b"{":  # a manifest is JSON; a slot file starts with llama.cpp's binary magic
        return _manifest_main(Path(args.file), args.json)
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
