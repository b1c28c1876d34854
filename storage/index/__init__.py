"""The index on Redis: what is where right now, rebuilt from the blob stores when lost.

:mod:`~storage.index.keyspace` names the keys and runs transactions; :mod:`~storage.index.session_index`
keeps session records (:mod:`~storage.index.records`) and engine occupancy
(:mod:`~storage.index.occupancy`) in step; :mod:`~storage.index.locks` fences writers;
:mod:`~storage.index.engines` is the engine registry; :mod:`~storage.index.prefix_digests` and
:mod:`~storage.index.shared_prefixes` route conversations and agents' shared prefixes to sessions;
:mod:`~storage.index.usage` counts per tenant; :mod:`~storage.index.turnops` is the request path's
round trips; :mod:`~storage.index.reindex` rebuilds it all from the store.
"""
