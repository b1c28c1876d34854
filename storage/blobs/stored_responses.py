"""Stored Responses-API responses: durable pointers into sessions, one JSON document each.

A stored response keeps what `previous_response_id` needs to continue it anywhere: the session
that holds its state, the model, the conversation up to and including its output (as chat
messages, so the next turn renders the same prompt and the engine reuses the slot state), the
response object as answered, and its input items. The document lives in the blob store under the
tenant (`{tenant}/.responses/{id}.json`), so it survives restarts of every process and is read by
any gateway replica; another tenant's id is simply not found.

A document that does not parse, has another version or belongs to another tenant is reported as
not found (and logged): it can never continue a session with a wrong history.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import structlog

from storage.blobs.blobstore import BlobStore
from storage.errors import InvalidId, NotStored
from storage.ids import validate_id

log = structlog.get_logger("slotkeeper.storage")

KIND = "responses"
VERSION = 1


def new_response_id() -> str:
    return "resp_" + secrets.token_hex(24)


@dataclass(frozen=True)
class StoredResponse:
    """One stored response. Its JSON is the Responses translation's objects as the gateway saves
    them (engine_pool.protocol.openai_responses), and when loaded, JSON checked only as far as
    `decode` says: objects, whatever keys they hold (storage knows no API's types)."""

    id: str
    tenant: str
    session: str
    model: str
    response: Mapping[str, Any]  # the Response object as answered
    input_items: Sequence[Mapping[str, Any]]
    history: Sequence[Mapping[str, Any]]  # chat messages up to and including this response's output

    def encode(self) -> bytes:
        doc = {
            "version": VERSION,
            "id": self.id,
            "tenant": self.tenant,
            "session": self.session,
            "model": self.model,
            "response": self.response,
            "input_items": self.input_items,
            "history": self.history,
        }
        return json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, tenant: str, response_id: str, data: bytes) -> StoredResponse:
        """The document, checked; ValueError naming what is wrong."""
        try:
            doc = json.loads(data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ValueError(f"not JSON: {exc}") from None
        if not isinstance(doc, dict) or doc.get("version") != VERSION:
            raise ValueError(f"not a version {VERSION} stored response")
        if doc.get("id") != response_id or doc.get("tenant") != tenant:
            raise ValueError("the document names another response or tenant")
        fields = {
            "session": str,
            "model": str,
            "response": dict,
            "input_items": list,
            "history": list,
        }
        for name, kind in fields.items():
            if not isinstance(doc.get(name), kind):
                raise ValueError(f"'{name}' must be a {kind.__name__}")
        if not all(isinstance(m, dict) for m in doc["history"] + doc["input_items"]):
            raise ValueError("history and input items must be objects")
        validate_id(doc["session"], "session id")
        return cls(
            response_id,
            tenant,
            doc["session"],
            doc["model"],
            doc["response"],
            doc["input_items"],
            doc["history"],
        )


class ResponseStore:
    """Stored responses of every tenant, in a blob store (which owns the bytes)."""

    def __init__(self, store: BlobStore) -> None:
        self.store = store

    async def save(self, stored: StoredResponse) -> None:
        await self.store.put_document(stored.tenant, KIND, stored.id, stored.encode())
        log.info("response.stored", tenant=stored.tenant, response=stored.id, session=stored.session)

    async def load(self, tenant: str, response_id: str) -> StoredResponse:
        """The stored response; NotStored when it is absent, damaged or not a valid id."""
        try:
            validate_id(response_id, "response id")
        except InvalidId:
            raise NotStored(f"response {response_id!r} not found") from None
        data = await self.store.get_document(tenant, KIND, response_id)
        try:
            return StoredResponse.decode(tenant, response_id, data)
        except (ValueError, InvalidId) as exc:
            log.error("response.damaged", tenant=tenant, response=response_id, error=str(exc))
            raise NotStored(f"response {response_id!r} not found (its stored copy is damaged)") from None

    async def delete(self, tenant: str, response_id: str) -> None:
        """Delete a stored response; NotStored when there is none."""
        await self.load(tenant, response_id)
        await self.store.delete_document(tenant, KIND, response_id)
        log.info("response.deleted", tenant=tenant, response=response_id)
