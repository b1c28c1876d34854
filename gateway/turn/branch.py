"""Branches, never rollbacks: a turn continues the session it reached, or branches from it.

A session's state is the conversation its last turn left in its slot: that turn's prompt and the
reply. Its record keeps the prompt's digest, its *head* (gateway.turn.prompt.head_digest). A request
continues the session when its messages hold that head followed by a reply — an assistant message
at that place, whatever its text (templates render it again; clients send it back in their own
form). The same prompt sent again (a regenerate, a retry) runs on the session too: it gives up only
the reply, and the engine keeps a checkpoint at the end of every prompt, so going on from the first
reply later costs just that reply's tokens. Every other request that reaches the session — a
parallel conversation that opens alike, an edited earlier message, an agent's fork command, a
compacted history under the same agent session id, an agent's side request (a title) under its
conversation's id — would roll the session's state back in its slot. It branches instead: a new
session (a fork, gateway.turn.hold.fork) that starts from the reached one's state, copied from its
live slot or restored from its stored generation, and evaluates only what differs; the reached
session keeps its state for its own next turn. Each branch then goes on with full reuse, in a slot
of its own, so two branches' turns run in parallel.

A request that names its session (`X-Session-Id`, which OpenCode sends too, or another agent's
signal: Claude Code's, Codex's, `prompt_cache_key`) and does not continue it may continue one of its
branches: the session implicit routing finds for its history (gateway.turn.resolve.find_conversation)
is taken when the request continues it — a compacted agent conversation, the side of a branch the
client went on with, or a conversation whose first turn was forked around its agent's title request
keeps its own session under the id the agent sends.

When the request holds the head but its reply differs from the one the session recorded (a
regenerated answer the client went on with, or a client that sends replies back in its own form),
such a request asks implicit routing too: a session that recorded exactly this reply (a fork the
client went on with) is the one it continues; with none, the named session goes on.

`continuation` decides (pure); `TurnRunner` (gateway.turn.runner) carries the decision out under the
session's lock, and the answer names the branch's parent (`X-Slotkeeper-Branch-Of`).
"""

from __future__ import annotations

from enum import StrEnum

from gateway.turn.prompt import Prompt
from gateway.turn.signals import SIGNALS
from storage.index.records import SessionRecord

# How a session was found when the request names it (gateway.turn.signals): such a turn that does not
# continue the session looks for the branch it continues before branching anew.
NAMED_SOURCES = frozenset(signal.source for signal in SIGNALS)


class Continuation(StrEnum):
    """How a prompt relates to the state of the session it reached."""

    EXACT = "exact"  # it goes on from the session's last prompt and reply, or is that prompt again
    REPLY = "reply"  # from its last prompt, with another reply (or the reply in another form)
    NONE = "none"  # from elsewhere: it branches


def continuation(record: SessionRecord | None, prompt: Prompt | None) -> Continuation:
    """How a turn for ``prompt`` relates to the session of ``record``: nothing to keep (no record,
    none of its turns finished yet, a request that is not a chat) counts as going on exactly."""
    if record is None or prompt is None or not record.head or record.head == prompt.head:
        return Continuation.EXACT
    if record.head not in prompt.heads:
        return Continuation.NONE
    if not record.route or record.route in prompt.turns:
        return Continuation.EXACT
    return Continuation.REPLY


def continues(record: SessionRecord | None, prompt: Prompt | None) -> bool:
    """Whether a turn for ``prompt`` may run on the session of ``record`` without rolling it back."""
    return continuation(record, prompt) is not Continuation.NONE


def looks_further(source: str) -> bool:
    """Whether a turn found this way asks implicit routing for the session it continues when it
    does not go on exactly from its own (see the module doc)."""
    return source in NAMED_SOURCES
