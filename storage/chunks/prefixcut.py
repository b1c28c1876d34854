"""A stored generation cut back to one of its checkpoints: the v1 slot file of its first P tokens,
assembled from the pieces up to P only. Pure functions; :mod:`storage.chunks.chunkstore` moves the bytes.

A prompt that leaves a hybrid session early (an agent that edits an earlier message, a retry from
a point far back) is continued by the engine from the newest checkpoint inside the common prefix:
the attention KV of the first P tokens and the recurrent state checkpoint P holds. Everything the
session stored after P is restored and then thrown away. Cut here instead, a restore fetches the
KV chunks up to P, the checkpoints up to P and the tail (which holds the metadata), and writes the
file the engine would have been left with: tokens and KV cells ``[0, P)``, checkpoint P's recurrent
state as the rest of the state (a checkpoint is ``llama_state_seq_get_data`` of the recurrent part
only: the same bytes that follow the attention KV in a whole state, after an 8-byte sequence
prefix), checkpoint P's logits as the last logits where it kept them (a prompt's end), the
checkpoints up to P, and META saying so.

Which P: the engine's rule (``native/src/reuse.cpp``, step 3): the newest checkpoint at or before
the prompt's common prefix with the saved tokens and its length. The prompt's tokens are matched
against the checkpoints' names (the running digest of the tokens each covers), so nothing is
fetched to choose. A prompt that repeats every saved token is continued from the end, not from a
checkpoint: no cut then (:func:`cut_point` answers None), and a cut is only made for hybrid models
(attention KV chunked, recurrent state in checkpoints), where the engine has no other way back.
The file differs from the whole one only in what the engine would drop: the turn that follows
evaluates the same tokens from the same state, so its answer and ``prompt_n`` are the same.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from storage.chunks.chunking import (
    KvLayout,
    chain,
    checkpoint_digest,
    pack_parts,
    range_digest,
    unpack_parts,
)
from storage.errors import SlotFileError
from storage.slotfile.format import TAG_LAST_LOGITS, TAG_META

_U32 = struct.Struct("<I")
_ENTRY_HEAD = struct.Struct("<qiiQ")  # a checkpoint entry: n_tokens, pos_min, pos_max, state bytes
_SEQ_PREFIX = 8  # a sequence state's magic and sequence id, before its memory sections
CUT_TAIL = "cut-tail"  # the name of the tail a cut writes in place of the stored one


def _digest(name: str) -> str:
    return name.rsplit("-", 1)[0]


def cut_point(plan: Mapping[str, Any], ns: str, tokens: Sequence[int]) -> int | None:
    """P for a prompt of ``tokens``: the newest checkpoint whose tokens the prompt repeats, when
    the engine would continue from it (None: restore the whole generation). Reads the plan only."""
    if plan.get("layout") is None or not plan.get("checkpoints") or not tokens:
        return None
    n, c = int(plan["n_tokens"]), int(plan["chunk_tokens"])
    prompt = np.asarray(tokens, dtype=np.int64)
    if prompt.min() < -(1 << 31) or prompt.max() >= 1 << 31:
        return None
    prompt = prompt.astype("<i4")
    heads = chain(ns, prompt, c, len(prompt) // c)
    bounds, chunks = [int(b) for b in plan["bounds"]], plan["chunks"]
    if len(prompt) >= n and len(bounds) == len(chunks) + 1:
        # Every saved token repeated? The whole chunks by their names, the rest cannot be told from
        # the plan: assume it is, and restore it all (the engine then continues from the end).
        if all(
            _digest(name) == range_digest(heads, prompt, a, b, c)
            for (name, _), a, b in zip(chunks, bounds, bounds[1:], strict=False)
        ):
            return None
    best = None
    for entry in plan["checkpoints"]:
        at = int(entry[0])
        if (
            0 < at <= len(prompt)
            and at <= bounds[-1]
            and _digest(str(entry[1])) == checkpoint_digest(heads, prompt, at, c)
        ):
            best = at if best is None else max(best, at)
    return best if best is not None and best < n else None


def repeats_first_chunk(plan: Mapping[str, Any], ns: str, tokens: Sequence[int]) -> bool:
    """Whether a prompt of ``tokens`` repeats the generation's first whole KV chunk (by its name:
    nothing is fetched). A generation without chunks (no layout) cannot tell: True."""
    chunks, bounds = plan.get("chunks") or [], [int(b) for b in plan.get("bounds") or []]
    if plan.get("layout") is None:
        return True
    c = int(plan["chunk_tokens"])
    if not chunks or len(bounds) < 2 or bounds[:2] != [0, c] or len(tokens) < c:
        return False
    prompt = np.asarray(tokens[:c], dtype=np.int64)
    if prompt.min() < -(1 << 31) or prompt.max() >= 1 << 31:
        return False
    prompt = prompt.astype("<i4")
    return _digest(str(chunks[0][0])) == range_digest(chain(ns, prompt, c, 1), prompt, 0, c, c)


def hybrid(tail: bytes) -> bool:
    """Whether a stored tail's metadata names a hybrid model (attention KV and recurrent state):
    the only kind the engine continues from a checkpoint and nowhere else. A sliding-window model
    may keep more (it trims its KV while the window is still cached), so it is never cut."""
    try:
        for record in unpack_parts(tail, "tail")[2:]:
            if _U32.unpack_from(record, 0)[0] == TAG_META:
                return _hybrid_meta(json.loads(bytes(record[8:])))
    except (SlotFileError, ValueError, struct.error):
        pass
    return False


def _hybrid_meta(meta: Any) -> bool:
    model = meta.get("model") if isinstance(meta, dict) else None
    return isinstance(model, dict) and model.get("hybrid") is True


def pieces_up_to(plan: Mapping[str, Any], at: int) -> tuple[list[int], list[int]]:
    """Indices of the chunks (whole or the one ``at`` falls inside) and checkpoints a cut at ``at``
    reads."""
    bounds = [int(b) for b in plan["bounds"]]
    chunks = [i for i in range(len(plan["chunks"])) if bounds[i] < at]
    ckpts = [j for j, e in enumerate(plan["checkpoints"]) if int(e[0]) <= at]
    return chunks, ckpts


def cut(
    plan: Mapping[str, Any], objects: Mapping[str, bytes], at: int
) -> tuple[dict[str, Any], dict[str, bytes]]:
    """The plan and objects of the v1 file of the first ``at`` tokens (for
    :func:`storage.chunks.chunking.write_v1`, which computes its CRC: the plan names none). ``objects``
    holds the stored tail and the pieces :func:`pieces_up_to` names. Raises
    :class:`SlotFileError` when the pieces do not allow it (the caller restores the whole)."""
    try:
        return _cut(plan, objects, at)
    except (KeyError, IndexError, TypeError, ValueError, OverflowError, struct.error) as exc:
        why = f"{type(exc).__name__}: {exc}"
        raise SlotFileError("bad_layout", f"cannot cut the generation at {at}: {why}") from exc


def _cut(
    plan: Mapping[str, Any], objects: Mapping[str, bytes], at: int
) -> tuple[dict[str, Any], dict[str, bytes]]:
    layout = KvLayout.from_json(plan["layout"])
    bounds = [int(b) for b in plan["bounds"]]
    chunk_ids, ckpt_ids = pieces_up_to(plan, at)
    whole = [i for i in chunk_ids if bounds[i + 1] <= at]
    if at > bounds[-1] or not ckpt_ids or int(plan["checkpoints"][ckpt_ids[-1]][0]) != at:
        raise ValueError("no checkpoint there")
    inside = [i for i in chunk_ids if bounds[i + 1] > at]  # the chunk ``at`` cuts, if any
    start = bounds[inside[0]] if inside else (bounds[whole[-1] + 1] if whole else 0)
    if inside:
        cells = _slice_range(objects[plan["chunks"][inside[0]][0]], layout, at - start)
    else:
        cells = pack_parts([b""] * (2 + len(layout.k) + len(layout.v)))
    ck_entry = plan["checkpoints"][ckpt_ids[-1]]
    ck_parts = unpack_parts(objects[str(ck_entry[1])], "checkpoint")
    # Only a prompt's end keeps its logits (native engine_checkpoints.cpp): a cut at a hint or an
    # interval has none to give, and the prompt that continues past it evaluates fresh ones.
    logits = bytes(ck_parts[1]) if len(ck_parts) > 1 else None
    n_tokens, _, _, state_len = _ENTRY_HEAD.unpack_from(ck_parts[0], 0)
    if n_tokens != at or state_len < _SEQ_PREFIX or _ENTRY_HEAD.size + state_len > len(ck_parts[0]):
        raise ValueError("the checkpoint entry does not describe its state")
    rest = ck_parts[0][_ENTRY_HEAD.size + _SEQ_PREFIX : _ENTRY_HEAD.size + state_len]
    tail = unpack_parts(objects[plan["tail"][0]], "tail")
    meta_record, order = None, []
    kept = {j: k for k, j in enumerate(ckpt_ids)}
    for item in plan["records"]:
        kind, idx = item[0], int(item[1:])
        if kind == "c":
            if idx in kept:
                order.append(f"c{kept[idx]}")
            continue
        (tag,) = _U32.unpack_from(tail[2 + idx], 0)
        if tag == TAG_META:
            meta_record = tail[2 + idx]
            order.append("t0")
        elif tag == TAG_LAST_LOGITS:
            if logits is not None:
                order.append("t1")
        else:
            raise ValueError(f"a record the cut does not know (tag {tag})")
    if meta_record is None:
        raise ValueError("the tail has no metadata")
    meta = json.loads(bytes(meta_record[8:]))
    if not _hybrid_meta(meta):
        raise ValueError("not a hybrid model")
    meta["n_tokens"] = at
    if isinstance(meta.get("checkpoints"), list):
        meta["checkpoints"] = [c for c in meta["checkpoints"] if int(c.get("n_tokens", 0)) <= at]
    records = [bytes(meta_record[:8]) + json.dumps(meta, separators=(",", ":")).encode()]
    if "t1" in order:
        records.append(_U32.pack(TAG_LAST_LOGITS) + _U32.pack(0) + bytes(logits or b""))
    new_tail = pack_parts([cells, bytes(rest), *records])
    out = {
        **{k: v for k, v in plan.items() if k not in ("size", "crc32", "body_crc32")},
        "n_tokens": at,
        "chunks": [plan["chunks"][i] for i in whole],
        "bounds": bounds[: len(whole) + 1],
        "checkpoints": [plan["checkpoints"][j] for j in ckpt_ids],
        "tail": [CUT_TAIL, len(new_tail)],
        "records": order,
    }
    objs = {str(plan["chunks"][i][0]): objects[str(plan["chunks"][i][0])] for i in whole}
    objs.update({str(plan["checkpoints"][j][1]): objects[str(plan["checkpoints"][j][1])] for j in ckpt_ids})
    objs[CUT_TAIL] = new_tail
    return out, objs


def _slice_range(payload: bytes, layout: KvLayout, k: int) -> bytes:
    """A KV range's piece cut to its first ``k`` cells."""
    parts = unpack_parts(payload, "chunk")
    if len(parts) != 2 + len(layout.k) + len(layout.v):
        raise ValueError("the chunk does not have the layout's parts")
    out = [bytes(parts[0][: 4 * k]), bytes(parts[1][: k * layout.cell_bytes])]
    for _, row in layout.k:
        out.append(bytes(parts[len(out)][: k * row]))
    for _, size, n_embd in layout.v:
        data = parts[len(out)]
        if layout.v_trans:
            cols = np.frombuffer(data, dtype=np.uint8).reshape(n_embd, -1)
            out.append(np.ascontiguousarray(cols[:, : k * size]).tobytes())
        else:
            out.append(bytes(data[: k * size]))
    return pack_parts(out)
