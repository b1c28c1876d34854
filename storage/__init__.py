"""Slotkeeper storage: slot files, blob stores (local and S3), content-addressed chunks and the Redis
index.

Everything here is async for callers (boto3 and file work run in threads) and takes its settings
and clients as constructor arguments; nothing reads the environment. One subpackage per concept:

* :mod:`storage.slotfile` — the slot-file format v1: reader and validator, ``slotkeeper inspect``;
* :mod:`storage.blobs` — where generations are kept: the blob-store interface, the local and S3
  stores, the node's spill cache in front of them, stored Responses-API documents;
* :mod:`storage.chunks` — a generation as content-addressed pieces behind the blob-store interface:
  splitting, the chunked store, prefix cuts, the piece codec and the chunk ledger;
* :mod:`storage.index` — the Redis index: session records, locks, engine registry, routing digests,
  tenant counters, the request path's round trips and ``slotkeeper reindex``.

What all of them share stays here: :mod:`storage.errors` (the one error hierarchy), :mod:`storage.ids`
(id validation and blob keys), :mod:`storage.checksum` (CRC-32), :mod:`storage.background`
(low-priority threads for saves) and :mod:`storage.probe` (start-up checks of the store and Redis).
Import each thing from the module that holds it; this package re-exports nothing.

No botocore or redis-py exception escapes: each becomes a :class:`~storage.errors.StorageError` with
an HTTP status and code (``StoreMisconfigured``, ``StoreUnavailable``...). ``OSError`` about the
caller's own local files (a missing source path) passes through unchanged.
"""
