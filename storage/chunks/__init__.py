"""Chunks: a generation stored as content-addressed pieces shared within a tenant.

:mod:`~storage.chunks.chunking` takes a slot file apart and puts it back (pure),
:mod:`~storage.chunks.placement` says where each piece's parts go in that file (pure),
:mod:`~storage.chunks.assembly` writes the file from its pieces, all at once or as they arrive,
:mod:`~storage.chunks.prefixcut` assembles the file of a prefix from its pieces (pure),
:mod:`~storage.chunks.codec` (with the compiled ``_planes``) encodes a piece,
:mod:`~storage.chunks.chunkstore` moves pieces through any blob store behind the blob-store interface,
and :mod:`~storage.chunks.ledger` keeps saves and the collector of unreferenced pieces apart on Redis.
"""
