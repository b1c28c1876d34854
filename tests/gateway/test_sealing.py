"""gateway/sealing.py: reasoning sealed for store:false clients opens only here, only for its
tenant; a forged, foreign or damaged one is a precise 400 naming the item's field, never decoded;
`slotkeeper serve`'s key survives its restarts."""

from __future__ import annotations

import base64
import os
import stat
from pathlib import Path

import pytest

from engine_pool.errors import BadRequest
from gateway.sealing import PREFIX, ReasoningSeal, persisted_key

WHERE = "input[3].encrypted_content"
TEXT = "The user wants a file listed. ls first, then 🙂 — and a lone \ud800 surrogate."


def _refused(seal: ReasoningSeal, tenant: str, sealed: str) -> str:
    with pytest.raises(BadRequest) as exc:
        seal.open(tenant, sealed, WHERE)
    assert exc.value.status == 400 and exc.value.param == WHERE
    assert exc.value.message.startswith(f"'{WHERE}'")
    return exc.value.message


def test_sealed_reasoning_opens_for_its_tenant_and_hides_its_text() -> None:
    seal = ReasoningSeal("deployment-key")
    sealed = seal.seal("acme", TEXT)
    assert sealed.startswith(PREFIX) and "ls first" not in sealed
    assert seal.seal("acme", TEXT) != sealed  # a fresh nonce each time
    assert seal.open("acme", sealed, WHERE) == TEXT
    # Another replica of the deployment (the same key) opens it too.
    assert ReasoningSeal("deployment-key").open("acme", sealed, WHERE) == TEXT


def test_foreign_forged_and_damaged_texts_are_refused_precisely() -> None:
    seal = ReasoningSeal("deployment-key")
    sealed = seal.seal("acme", TEXT)
    assert "sealed for another tenant" in _refused(seal, "globex", sealed)
    assert "sealed under another key" in _refused(ReasoningSeal("other-deployment"), "acme", sealed)
    body = sealed[len(PREFIX) :]
    raw = bytearray(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
    raw[-1] ^= 1  # one bit of the tag
    flipped = PREFIX + base64.urlsafe_b64encode(bytes(raw)).decode().rstrip("=")
    assert "damaged, or it was sealed for another tenant" in _refused(seal, "acme", flipped)
    assert "is damaged" in _refused(seal, "acme", PREFIX + "!!not base64!!")
    assert "is damaged" in _refused(seal, "acme", sealed[:30])
    # What OpenAI seals (or anything else) is not ours to open.
    assert "was not sealed by this server" in _refused(seal, "acme", "gAAAAABo-openai-sealed")


def test_the_key_is_the_sealing_key_else_the_internal_one() -> None:
    internal = ReasoningSeal.for_keys(None, "internal")
    assert ReasoningSeal("internal").open("t", internal.seal("t", "x"), WHERE) == "x"
    own = ReasoningSeal.for_keys("sealing", "internal")
    assert "another key" in _refused(ReasoningSeal("internal"), "t", own.seal("t", "x"))
    ephemeral = ReasoningSeal.for_keys(None, None)  # an embedded gateway: this process only
    assert ephemeral.open("t", ephemeral.seal("t", "x"), WHERE) == "x"


def test_serve_keeps_one_key_in_its_data_dir(tmp_path: Path) -> None:
    data = tmp_path / "data"
    key = persisted_key(data)
    assert persisted_key(data) == key and len(key) == 64
    assert stat.S_IMODE(os.stat(data / "sealing.key").st_mode) == 0o600
    assert [p.name for p in data.iterdir()] == ["sealing.key"]  # nothing left aside
    (data / "sealing.key").write_text("short\n")
    with pytest.raises(ValueError, match="holds no sealing key"):
        persisted_key(data)
