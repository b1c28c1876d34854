"""Reasoning sealed for the clients that keep nothing on the server: the Responses API's
`encrypted_content` (`store: false` with `include: ["reasoning.encrypted_content"]`).

A reasoning item comes back with its text sealed: AES-256-GCM (the `cryptography` package) under
a key derived from the gateway's sealing key, with the tenant's name as associated data, so that
only this deployment opens it, and only for that tenant. The client sends the item back with its
next turn (Codex replays every item) and the prompt is rendered from the opened text — the tokens
of the turn that generated it, so the slot's state is reused whole.

A sealed text is `skr1_` + base64url(key id (8 bytes) | nonce (12) | ciphertext and tag). The key
id (a digest of the derived key, which tells nothing of it) sets a text sealed under another key
(another deployment's, or this one's before its key changed) apart from one that is damaged or
another tenant's (whose tag does not verify); each is a 400 naming the input item's field, and
none is ever decoded.

The key: `SLOTKEEPER_SEALING_KEY`; without it, derived from the internal credential (which every
gateway replica of a deployment holds). `slotkeeper serve`, whose internal credential is new on
every start unless given, keeps a key in its data directory (`persisted_key`), so that sealed items
survive its restarts. Without either (an embedded gateway), a key of this process only, logged.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import secrets
from pathlib import Path

import structlog
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from engine_pool.errors import BadRequest

log = structlog.get_logger("slotkeeper.gateway")

PREFIX = "skr1_"
_KEY_INFO = b"slotkeeper/reasoning-seal/v1"
_AAD = b"slotkeeper/reasoning/v1\x00"
_KID, _NONCE, _TAG = 8, 12, 16
KEY_FILE = "sealing.key"


class ReasoningSeal:
    """Seals and opens reasoning texts for one deployment (one key), bound to a tenant."""

    def __init__(self, secret: str) -> None:
        key = hmac.new(secret.encode(), _KEY_INFO, hashlib.sha256).digest()
        self._aead = AESGCM(key)
        self._kid = hashlib.sha256(b"key id\x00" + key).digest()[:_KID]

    @classmethod
    def for_keys(cls, sealing_key: str | None, internal_key: str | None) -> ReasoningSeal:
        """The seal of a gateway's settings: its sealing key, else its internal credential, else a
        key of this process only (sealed items then open only until it ends)."""
        secret = sealing_key or internal_key
        if secret is None:
            log.warning(
                "sealing.ephemeral_key",
                why="neither SLOTKEEPER_SEALING_KEY nor SLOTKEEPER_INTERNAL_KEY is set: reasoning "
                "sealed for store:false clients opens only until this process ends",
            )
            secret = secrets.token_hex(32)
        return cls(secret)

    def seal(self, tenant: str, text: str) -> str:
        nonce = os.urandom(_NONCE)
        sealed = self._aead.encrypt(nonce, text.encode("utf-8", "surrogatepass"), _AAD + tenant.encode())
        return PREFIX + base64.urlsafe_b64encode(self._kid + nonce + sealed).decode().rstrip("=")

    def open(self, tenant: str, sealed: str, where: str) -> str:
        """The text `sealed` holds for `tenant`, or BadRequest naming `where` (the item's field)."""
        if not sealed.startswith(PREFIX):
            raise BadRequest(
                f"'{where}' was not sealed by this server (reasoning encrypted by another provider "
                "cannot be opened here): send the reasoning item without it, or leave the item out",
                param=where,
            )
        body = sealed[len(PREFIX) :]
        try:
            raw = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
        except (binascii.Error, ValueError):
            raw = b""
        if len(raw) < _KID + _NONCE + _TAG:
            raise BadRequest(f"'{where}' is damaged: it is not a sealed reasoning text", param=where)
        kid, nonce, rest = raw[:_KID], raw[_KID : _KID + _NONCE], raw[_KID + _NONCE :]
        if not hmac.compare_digest(kid, self._kid):
            raise BadRequest(
                f"'{where}' was sealed under another key (another deployment's, or this one's before "
                "its sealing key changed) and cannot be opened here",
                param=where,
            )
        try:
            text = self._aead.decrypt(nonce, rest, _AAD + tenant.encode())
        except InvalidTag:
            raise BadRequest(
                f"'{where}' does not open for this tenant: it is damaged, or it was sealed for another "
                "tenant",
                param=where,
            ) from None
        return text.decode("utf-8", "surrogatepass")


def persisted_key(data_dir: Path) -> str:
    """The sealing key kept in `data_dir`, made on first use (32 random bytes, hex, mode 0600;
    written aside and linked into place, so a reader never sees half a key)."""
    path = data_dir / KEY_FILE
    if not path.exists():
        data_dir.mkdir(parents=True, exist_ok=True)
        aside = data_dir / f".{KEY_FILE}.{os.getpid()}"
        fd = os.open(aside, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32) + "\n")
        try:
            os.link(aside, path)
        except FileExistsError:  # another process made it first: theirs it is
            pass
        finally:
            aside.unlink()
    key = path.read_text().strip()
    if len(key) < 32:
        raise ValueError(f"{path} holds no sealing key (32 characters or more expected)")
    return key
