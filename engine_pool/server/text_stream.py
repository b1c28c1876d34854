"""From token pieces to text deltas: incremental UTF-8 decoding and stop strings with hold-back.

A token's piece may end inside a multi-byte character, and a stop string may span several tokens.
`TextStream.feed` therefore only releases text that can no longer change: complete characters that
cannot be the beginning of a stop string. Pure, no I/O.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence


class StopMatcher:
    """Finds the earliest stop string in a growing text, holding back a possible partial match."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self._held = ""
        self.matched: str | None = None

    def feed(self, text: str) -> str:
        """Text that is safe to emit now. After a match (`self.matched`), nothing more is emitted."""
        if self.matched is not None:
            return ""
        buf = self._held + text
        hit = min(
            ((buf.find(s), s) for s in self.stops if s in buf),
            default=None,
            key=lambda t: t[0],
        )
        if hit is not None:
            self._held = ""
            self.matched = hit[1]
            return buf[: hit[0]]
        keep = self._partial_suffix(buf)
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep]

    def _partial_suffix(self, buf: str) -> int:
        longest = max((len(s) for s in self.stops), default=0)
        for k in range(min(len(buf), longest - 1), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0

    def flush(self) -> str:
        """The held-back text once no more text will come (it was not a stop after all)."""
        out, self._held = ("" if self.matched is not None else self._held), ""
        return out


class TextStream:
    """Token pieces (bytes) in, text deltas out, stopping at the first stop string."""

    def __init__(self, stops: Sequence[str] = ()) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.stop = StopMatcher(stops)
        self.text = ""  # everything emitted so far

    @property
    def stopped_by(self) -> str | None:
        return self.stop.matched

    def feed(self, piece: bytes) -> str:
        delta = self.stop.feed(self._decoder.decode(piece))
        self.text += delta
        return delta

    def finish(self) -> str:
        """The rest: an incomplete character as U+FFFD, a held-back partial stop string."""
        delta = self.stop.feed(self._decoder.decode(b"", final=True)) + self.stop.flush()
        self.text += delta
        return delta
