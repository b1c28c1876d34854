"""Blob stores: where generations (slot files) and small documents are kept, the source of truth.

:mod:`~storage.blobs.blobstore` is the async interface (objects addressed by ``SlotRef``, conditional
writes, checksummed metadata); :mod:`~storage.blobs.localstore` and :mod:`~storage.blobs.s3store`
(with :mod:`~storage.blobs.s3client`, :mod:`~storage.blobs.s3upload` and :mod:`~storage.blobs.retry`)
implement it. :mod:`~storage.blobs.spillcache` is the node's disk tier in front of a store, and
:mod:`~storage.blobs.stored_responses` keeps Responses-API documents in one.
"""
