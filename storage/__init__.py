"""Slotkeeper storage: slot files, blob stores (local and S3), the spill cache and the Redis index.

Everything here is async for callers (boto3 and file work run in threads) and takes its settings
and clients as constructor arguments; nothing reads the environment. The usual entry points:

* :func:`storage.slotfile.read_slot_file` / :func:`storage.slotfile.verify_slot_file`
* :class:`storage.localstore.LocalStore`, :class:`storage.s3store.S3Store` (+ ``make_s3_client``)
* :class:`storage.chunkstore.ChunkedStore` over either: generations as content-addressed pieces
  (:mod:`storage.chunking`), shared within a tenant, counted and collected through
  :class:`storage.ledger.ChunkLedger`
* :func:`storage.blobstore.delete_generations` (all, or superseded, generations of a session)
* :class:`storage.spillcache.SpillCache`
* :class:`storage.index.SessionIndex` (records, stored bytes, generation floors, implicit routes,
  usage / windowed / in-flight counters), :class:`storage.locks.SessionLocks`,
  :class:`storage.engines.EngineRegistry` (on redis-py asyncio, or ``in_process_redis()``)
* :func:`storage.probe.probe_store`, :func:`storage.probe.probe_redis` (start-up checks)
* :func:`storage.reindex.reindex`; CLIs ``storage.inspect:main`` and ``storage.reindex:main``

No botocore or redis-py exception escapes: each becomes a :class:`StorageError` with an HTTP
status and code (:class:`StoreMisconfigured`, :class:`StoreUnavailable`...). ``OSError`` about the
caller's own local files (a missing source path) passes through unchanged.
"""

from storage.errors import (
    ChecksumError,
    Conflict,
    GenerationUsed,
    InvalidId,
    LockBusy,
    LockLost,
    NotFound,
    SlotFileError,
    StorageError,
    StoreMisconfigured,
    StoreUnavailable,
)
from storage.ids import SlotRef, validate_id

__all__ = [
    "ChecksumError",
    "Conflict",
    "GenerationUsed",
    "InvalidId",
    "LockBusy",
    "LockLost",
    "NotFound",
    "SlotFileError",
    "SlotRef",
    "StorageError",
    "StoreMisconfigured",
    "StoreUnavailable",
    "validate_id",
]
