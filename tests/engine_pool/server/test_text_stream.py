"""engine_pool/server/text_stream.py: incremental UTF-8 and stop strings with hold-back."""

from __future__ import annotations

import pytest

from engine_pool.server.text_stream import StopMatcher, TextStream


def feed_all(stream: TextStream, pieces: list[bytes]) -> list[str]:
    out = [stream.feed(p) for p in pieces]
    out.append(stream.finish())
    return out


def test_multibyte_characters_split_across_pieces() -> None:
    data = "héllo €uro 😀".encode()
    pieces = [data[i : i + 1] for i in range(len(data))]
    s = TextStream()
    deltas = feed_all(s, pieces)
    assert "".join(deltas) == "héllo €uro 😀" == s.text
    assert all("\ufffd" not in d for d in deltas)


def test_incomplete_character_at_the_end_becomes_a_replacement() -> None:
    s = TextStream()
    assert feed_all(s, [b"ab", "€".encode()[:2]]) == ["ab", "", "\ufffd"]


def test_stop_string_spanning_pieces_is_held_back_then_cut() -> None:
    s = TextStream(["</end>"])
    deltas = feed_all(s, [b"hello </", b"en", b"d> more"])
    assert deltas == ["hello ", "", "", ""]
    assert s.stopped_by == "</end>" and s.text == "hello "


def test_partial_stop_that_does_not_complete_is_released() -> None:
    s = TextStream(["STOP"])
    assert feed_all(s, [b"ST", b"OAT"]) == ["", "STOAT", ""]
    assert s.stopped_by is None


def test_partial_stop_at_the_very_end_is_flushed() -> None:
    s = TextStream(["STOP"])
    assert "".join(feed_all(s, [b"abc ST"])) == "abc ST"


@pytest.mark.parametrize(("stops", "expected"), [(["b", "abc"], "x"), (["cd", "bc"], "xa")])
def test_earliest_stop_wins(stops: list[str], expected: str) -> None:
    m = StopMatcher(stops)
    assert m.feed("xabcd") == expected
    assert m.feed("more") == ""
