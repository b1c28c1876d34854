"""Slotkeeper storage: slot files, blob stores (local and S3), the spill cache and the Redis index.

Everything here is async for callers (boto3 and file work run in threads) and takes its settings
and clients as constructor arguments; nothing reads the environment. The usual entry points:

* :func:`storage.slotfile.read_slot_file` / :func:`storage.slotfile.verify_slot_file`
* :class:`storage.localstore.LocalStore`, :class:`storage.s3store.S3Store` (+ ``make_s3_client``)
* :class:`storage.spillcache.SpillCache`
* :class:`storage.index.SessionIndex`, :class:`storage.locks.SessionLocks`,
  :class:`storage.engines.EngineRegistry` (on redis-py asyncio, or ``in_process_redis()``)
* :func:`storage.reindex.reindex`; CLIs ``storage.inspect:main`` and ``storage.reindex:main``
"""

from storage.errors import (
    ChecksumError,
    Conflict,
    InvalidId,
    LockBusy,
    LockLost,
    NotFound,
    SlotFileError,
    StorageError,
    StoreUnavailable,
)
from storage.ids import SlotRef, validate_id

__all__ = [
    "ChecksumError",
    "Conflict",
    "InvalidId",
    "LockBusy",
    "LockLost",
    "NotFound",
    "SlotFileError",
    "SlotRef",
    "StorageError",
    "StoreUnavailable",
    "validate_id",
]
