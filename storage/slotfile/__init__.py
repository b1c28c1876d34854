"""The slot file: the v1 on-disk format an engine writes for one slot's state (native/SLOTFILE.md is
authoritative).

:mod:`~storage.slotfile.format` holds the constants and bounded section parsers,
:mod:`~storage.slotfile.reader` reads and validates a whole file (``read_slot_file``,
``verify_slot_file``) and :mod:`~storage.slotfile.inspect` is ``slotkeeper inspect``. Pure Python,
no store or Redis: every other part of storage builds on this one.
"""
